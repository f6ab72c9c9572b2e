"""Typed configs: defaults, YAML, command line, in that order; clear errors."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from ray_credit.config import field_docs, parse_config, replace_path


@dataclass(frozen=True)
class Inner:
    lr: float = 1e-6
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    total: int | None = None
    """Total steps."""

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


@dataclass(frozen=True)
class Outer:
    name: str = "run"
    """Run name."""
    flag: bool = False
    """A switch."""
    inner: Inner = field(default_factory=Inner)


def test_defaults_yaml_then_flags(tmp_path):
    assert parse_config(Outer, []) == Outer()
    file = tmp_path / "c.yaml"
    file.write_text("name: from_yaml\ninner:\n  lr: 0.01\n  betas: [0.8, 0.9]\n")
    cfg = parse_config(Outer, ["--config", str(file), "--inner.lr", "0.5", "--flag", "true"])
    assert cfg == Outer(name="from_yaml", flag=True, inner=Inner(lr=0.5, betas=(0.8, 0.9)))
    cfg = parse_config(Outer, ["--inner.total", "none", "--inner.betas", "0.1,0.2"])
    assert cfg.inner.total is None and cfg.inner.betas == (0.1, 0.2)
    assert parse_config(Outer, ["--inner.total", "7"]).inner.total == 7


def test_help_shows_field_docs_and_defaults(capsys):
    with pytest.raises(SystemExit):
        parse_config(Outer, ["--help"])
    text = capsys.readouterr().out
    assert "--inner.lr" in text and "Learning rate. (default: 1e-06)" in text
    assert field_docs(Inner)["betas"] == "Adam betas."


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--inner.lr", "abc"], "--inner.lr"),
        (["--inner.lr", "-1"], "lr must be > 0"),
        (["--flag", "maybe"], "takes true or false"),
        (["--inner.total", "1.5"], "--inner.total"),
    ],
)
def test_bad_values_name_the_key(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_config(Outer, argv)
    assert message in capsys.readouterr().err


def test_unknown_yaml_key_is_an_error(tmp_path, capsys):
    file = tmp_path / "c.yaml"
    file.write_text("inner:\n  lrr: 0.1\n")
    with pytest.raises(SystemExit):
        parse_config(Outer, ["--config", str(file)])
    assert "unknown config key 'inner.lrr'" in capsys.readouterr().err


def test_replace_path():
    cfg = replace_path(Outer(), "inner.lr", "0.25")
    assert cfg.inner.lr == 0.25 and cfg.name == "run"
    with pytest.raises(ValueError, match="valid: \\['flag', 'inner', 'name'\\]"):
        replace_path(Outer(), "nope", 1)


def test_pipeline_configs_parse_with_every_field_documented():
    """Every leaf of the pipelines' config tree has a docstring (it is the --help text)."""
    from ray_credit.config import _leaves
    from ray_credit.pipeline.recipe import JudgeConfig, RunConfig
    from ray_credit.signals.cw_grpo_judgement import CWGRPOJudgement
    from ray_credit.signals.info_gain import InfoGain

    for cls in (RunConfig, JudgeConfig, CWGRPOJudgement, InfoGain):
        undocumented = [name for name, _k, _d, doc in _leaves(cls) if not doc]
        assert undocumented == [], cls
    cfg = parse_config(
        RunConfig,
        ["--learner.lr", "3e-5", "--generator.temperature", "1.0", "--learner.temperature", "1.0"],
    )
    assert cfg.learner.lr == 3e-5


def test_cross_section_check_runs_once_at_the_end(capsys):
    from ray_credit.pipeline.recipe import RunConfig

    with pytest.raises(SystemExit):
        parse_config(RunConfig, ["--generator.temperature", "0.7"])
    assert "--generator.temperature T --learner.temperature T together" in capsys.readouterr().err


def test_pairs_take_two_values_and_yaml_errors_name_the_file(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_config(Outer, ["--inner.betas", "0.9"])
    assert "takes 2 values" in capsys.readouterr().err
    file = tmp_path / "bad.yaml"
    file.write_text("inner: [unclosed\n")
    with pytest.raises(SystemExit):
        parse_config(Outer, ["--config", str(file)])
    assert f"--config {file}: not a readable YAML file" in capsys.readouterr().err


def test_default_config_file_and_skipped_sections(tmp_path):
    file = tmp_path / "defaults.yaml"
    file.write_text("name: from_default\nother_script: {x: 1}\n")
    cfg = parse_config(Outer, [], default_config=file, skip_sections=("other_script",))
    assert cfg.name == "from_default"
    mine = tmp_path / "mine.yaml"
    mine.write_text("flag: true\n")  # replaces the default file, not layered on it
    cfg = parse_config(
        Outer, ["--config", str(mine)], default_config=file, skip_sections=("other_script",)
    )
    assert cfg.name == "run" and cfg.flag


def test_rules_between_fields_see_every_setting_together(tmp_path):
    """Flags and the file are applied to each section at once: a rule between two fields
    holds for the final values, whatever order they come in."""
    from ray_credit.pipeline.recipe import RunConfig

    file = tmp_path / "c.yaml"
    file.write_text("pipeline: {groups_per_step: 4}\n")
    cfg = parse_config(
        RunConfig,
        ["--config", str(file), "--pipeline.chunk_groups", "8", "--pipeline.groups_per_step", "16",
         "--learner.lr_schedule", "cosine", "--learner.total_steps", "100",
         "--generator.max_new_tokens", "4096", "--generator.max_context_tokens", "8192"],
    )  # fmt: skip
    assert (cfg.pipeline.chunk_groups, cfg.pipeline.groups_per_step) == (8, 16)
    assert cfg.learner.total_steps == 100 and cfg.generator.max_context_tokens == 8192
