"""Typed configs: defaults, YAML, command line, in that order; clear errors."""

from __future__ import annotations

import re
import typing
from dataclasses import dataclass, field
from typing import Literal

import pytest

from ray_credit.config import check_fields, field_docs, parse_config, replace_path


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
    assert "inner has no setting 'lrr'; did you mean inner.lr?" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "yaml", "message"),
    [
        # a typo'd section, a typo'd field, another library's name for a field
        (["--innr.lr", "0.1"], "innr:\n  lr: 0.1\n", "no such setting; did you mean {d}inner.lr?"),
        (["--inner.betaz", "1,2"], "inner:\n  betaz: [1, 2]\n",
         "inner has no setting 'betaz'; did you mean {d}inner.betas?"),
        (["--inner.learning_rate", "0.1"], "inner:\n  learning_rate: 0.1\n",
         "inner has no setting 'learning_rate'; did you mean {d}inner.lr?"),
        # nothing near: the section's settings are listed
        (["--inner.zzz", "1"], "inner:\n  zzz: 1\n",
         "inner has no setting 'zzz'; its settings: {d}inner.lr, {d}inner.betas, {d}inner.total"),
        # a section another config has
        (["--igpo.gamma", "0.5"], "igpo:\n  gamma: 0.5\n", "igpo belongs elsewhere"),
        (["--inner", "1"], "inner: 1\n", "{d}inner is a section"),
        # a setting of the run's put in a section (wandb.init's name is the run's --name)
        (["--inner.name", "x"], "inner:\n  name: x\n", "inner has no setting 'name'; its "
         "settings: {d}inner.lr, {d}inner.betas, {d}inner.total; did you mean {d}name?"),
    ],
)  # fmt: skip
def test_an_unknown_flag_or_key_says_what_was_meant(tmp_path, capsys, argv, yaml, message):
    foreign = {"igpo": "igpo belongs elsewhere"}
    with pytest.raises(SystemExit):
        parse_config(Outer, argv, foreign_sections=foreign)
    err = capsys.readouterr().err
    assert f"unrecognized arguments: {' '.join(argv)}" in err or "--inner" in err
    assert message.format(d="--") in err, err
    file = tmp_path / "c.yaml"
    file.write_text(yaml)
    with pytest.raises(SystemExit):
        parse_config(Outer, ["--config", str(file)], foreign_sections=foreign)
    assert message.format(d="") in capsys.readouterr().err.replace("--igpo", "igpo")


def test_a_flag_is_never_taken_for_a_longer_one(capsys):
    # argparse would read --inner.tot as --inner.total; a setting is named in full
    with pytest.raises(SystemExit):
        parse_config(Outer, ["--inner.tot", "3"])
    assert "did you mean --inner.total?" in capsys.readouterr().err


def test_replace_path():
    cfg = replace_path(Outer(), "inner.lr", "0.25")
    assert cfg.inner.lr == 0.25 and cfg.name == "run"
    with pytest.raises(ValueError, match="valid: \\['flag', 'inner', 'name'\\]"):
        replace_path(Outer(), "nope", 1)


def test_pipeline_configs_parse_with_every_field_documented():
    """Every leaf of the pipelines' config tree has a docstring (it is the --help text)."""
    from ray_credit.config import _leaves
    from ray_credit.pipeline.configs import JudgeConfig, RunConfig
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
    from ray_credit.pipeline.configs import RunConfig

    with pytest.raises(SystemExit):
        parse_config(RunConfig, ["--generator.temperature", "0.7"])
    assert "--generator.temperature T --learner.temperature T together" in capsys.readouterr().err


def test_pairs_take_two_values_and_yaml_errors_name_the_file(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_config(Outer, ["--inner.betas", "0.9"])
    assert "takes 2 values" in capsys.readouterr().err
    file = tmp_path / "bad.yaml"

    def last_error_line(content: bytes) -> str:
        file.write_bytes(content)
        with pytest.raises(SystemExit):
            parse_config(Outer, ["--config", str(file)])
        return capsys.readouterr().err.splitlines()[-1]

    # one line that names the file, the line and column and what is wrong, not yaml's
    # message of five lines ending in a caret under a copy of the line
    last = last_error_line(b"inner: [unclosed\n")
    assert last.endswith(
        f"error: --config {file}:2:1: not a readable YAML file: expected ',' or ']', but got "
        "'<stream end>' (while parsing a flow sequence that starts at line 1, column 8)"
    ), last
    last = last_error_line(b"inner:\n\tlr: 0.5\n")
    assert last.endswith(
        f"--config {file}:2:1: not a readable YAML file: found character '\\t' that cannot "
        "start any token (while scanning for the next token); YAML indents with spaces, not tabs"
    ), last
    assert f"--config {file}:1:10: not UTF-8 (byte 0xe9)" in last_error_line(b"name: caf\xe9\n")


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
    from ray_credit.pipeline.configs import RunConfig

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


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--inner.total", "2.5"],
            r"--inner.total: inner.total takes an integer, got '2.5' \(or none\)",
        ),
        (["--inner.total", "ten"], r"--inner.total: inner.total takes an integer, got 'ten'"),
        (["--inner.lr", "abc"], r"--inner.lr: inner.lr takes a number, got 'abc'"),
        (["--inner.lr", "nan"], r"inner.lr takes a number, got 'nan' \(NaN\)"),
        (["--inner.lr", "-1"], r"--inner.lr: inner.lr must be > 0, got -1.0"),  # the section named
    ],
)
def test_value_errors_name_the_flag_and_the_section(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_config(Outer, argv)
    err = capsys.readouterr().err
    assert re.search(message, err), err
    # one usage line, not a list of every flag above the error
    assert err.startswith("usage: ") and len(err.splitlines()) == 2, err


def test_an_error_naming_two_flags_given_is_put_on_the_one_it_is_about(capsys):
    """name's refusal mentions output_dir ("written to output_dir/name"): with both given,
    the flag named before the error is --name, whose value it quotes."""
    from ray_credit.pipeline.configs import RunConfig

    with pytest.raises(SystemExit):
        parse_config(RunConfig, ["--output_dir", "runs", "--name", "a/b"])
    err = capsys.readouterr().err
    assert err.splitlines()[-1].endswith(
        "error: --name: name='a/b' must be a plain folder name (no slashes, not '.' or '..', "
        "not blank): the run is written to output_dir/name"
    ), err


def test_a_negative_first_value_of_a_list_flag_is_a_value():
    cfg = parse_config(Outer, ["--inner.betas", "-0.1,0.2", "--inner.lr", "0.5"])
    assert cfg.inner.betas == (-0.1, 0.2) and cfg.inner.lr == 0.5


def test_a_yaml_key_given_twice_is_refused(tmp_path, capsys):
    file = tmp_path / "c.yaml"
    file.write_text("inner:\n  lr: 0.5\nname: x\ninner:\n  total: 3\n")  # inner's lr lost
    with pytest.raises(SystemExit):
        parse_config(Outer, ["--config", str(file)])
    assert (
        f"--config {file}:4:1: 'inner' is given twice in one mapping (first at line 1); merge "
        "the two\n"
    ) in capsys.readouterr().err


def test_config_classes_refuse_values_of_the_wrong_type():
    from ray_credit.actors.generator import GeneratorConfig
    from ray_credit.actors.learner import LearnerConfig
    from ray_credit.actors.retrieval_server import RequestLimits
    from ray_credit.actors.retriever import EncoderConfig
    from ray_credit.actors.sampling import VLLMConfig
    from ray_credit.config import check_fields
    from ray_credit.pipeline import PipelineConfig
    from ray_credit.warm_start import WarmStartConfig

    nan = float("nan")
    cases = [
        (PipelineConfig, {"steps": 2.5}, "PipelineConfig.steps takes an integer, got 2.5"),
        (PipelineConfig, {"timeout_s": nan}, "timeout_s takes a number, not NaN"),
        (LearnerConfig, {"shuffle": "no"}, r"shuffle takes true or false \(a bool\), got 'no'"),
        (LearnerConfig, {"lr": "1e-5"}, "LearnerConfig.lr takes a number, got '1e-5' \\(str\\)"),
        (LearnerConfig, {"betas": 0.9}, "betas takes a tuple of values"),
        (LearnerConfig, {"betas": (0.9,)}, "betas takes 2 values"),
        (LearnerConfig, {"loss": {}}, "LearnerConfig.loss takes a PolicyLossConfig"),
        (GeneratorConfig, {"group_size": "5"}, "GeneratorConfig.group_size takes an integer"),
        (GeneratorConfig, {"vllm": {}}, "GeneratorConfig.vllm takes a VLLMConfig"),
        (VLLMConfig, {"enforce_eager": "no"}, "enforce_eager takes true or false"),
        (WarmStartConfig, {"epochs": 1.5}, "WarmStartConfig.epochs takes an integer"),
        (RequestLimits, {"max_queries": "10"}, "RequestLimits.max_queries takes an integer"),
        (EncoderConfig, {"batch_size": "64"}, "EncoderConfig.batch_size takes an integer"),
    ]
    for cls, kwargs, message in cases:
        with pytest.raises(TypeError, match=message):
            cls(**kwargs)

    @dataclass(frozen=True)
    class Part:
        x: int = 1

    @dataclass(frozen=True)
    class Local:  # an annotation only this function's scope resolves: not checked
        part: Part = field(default_factory=Part)

        def __post_init__(self):
            check_fields(self)

    assert Local(part="x").part == "x"


def test_config_classes_refuse_values_out_of_range():
    from ray_credit.actors.generator import GeneratorConfig
    from ray_credit.actors.learner import LearnerConfig
    from ray_credit.actors.retriever import EncoderConfig
    from ray_credit.losses import PolicyLossConfig
    from ray_credit.pipeline import PipelineConfig
    from ray_credit.pipeline.configs import (
        DataConfig,
        EvalConfig,
        JudgeConfig,
        ResourcesConfig,
        RetrieverConfig,
        RunConfig,
    )

    inf = float("inf")
    cases = [
        (LearnerConfig, {"betas": (1.5, 0.999)}, r"betas must each lie in \[0, 1\)"),
        (LearnerConfig, {"weight_decay": -0.5}, "weight_decay must be a finite number >= 0"),
        (LearnerConfig, {"entropy_coef": inf}, "entropy_coef must be a finite number >= 0"),
        (LearnerConfig, {"max_grad_norm": inf}, "max_grad_norm must be a positive finite"),
        (LearnerConfig, {"is_cap": inf}, "is_cap must be a finite number > 1"),
        (PolicyLossConfig, {"clip_high": inf}, "clip_high=inf must be finite"),
        (GeneratorConfig, {"temperature": inf}, "temperature must be finite and >= 0"),
        (GeneratorConfig, {"kv_reuse_gb": inf}, "kv_reuse_gb must be >= 0"),
        (PipelineConfig, {"timeout_s": inf}, "timeout_s must be a finite number of seconds"),
        (PipelineConfig, {"stage_cpus": inf}, "stage_cpus must be finite"),
        (ResourcesConfig, {"num_generators": 0}, "resources.num_generators must be >= 1"),
        (ResourcesConfig, {"learner_workers": 0}, "resources.learner_workers must be >= 1"),
        (ResourcesConfig, {"generator_cpus": -1.0}, "resources.generator_cpus must be a finite"),
        (ResourcesConfig, {"generator_max_restarts": -5}, "generator_max_restarts must be >= 0"),
        (ResourcesConfig, {"local_cpus": 0}, "resources.local_cpus must be >= 1"),
        (JudgeConfig, {"timeout_s": 0.0}, "judge.timeout_s must be a finite number"),
        (JudgeConfig, {"batch_size": 0}, "judge.batch_size must be >= 1"),
        (JudgeConfig, {"max_retries": -1}, "judge.max_retries must be >= 0"),
        (JudgeConfig, {"base_url": "localhost:8000"}, "judge.base_url='localhost:8000' must be an"),
        (RetrieverConfig, {"timeout_s": -5.0}, "retriever.timeout_s must be a finite number"),
        (RetrieverConfig, {"url": "localhost:8000"}, "must be an http:// or https:// URL"),
        (EvalConfig, {"max_new_tokens": 0}, "eval.max_new_tokens must be >= 1"),
        (EvalConfig, {"samples": -1}, "eval.samples must be >= 0"),
        (DataConfig, {"corpus": "c.jsonl"}, "data.corpus='c.jsonl' is set but data.questions"),
        (RunConfig, {"name": ""}, "name='' must be a plain folder name"),
        (RunConfig, {"name": "../../etc"}, "must be a plain folder name"),
        (EncoderConfig, {"device": "gpu"}, "encoder device 'gpu' is not one of"),
        (EncoderConfig, {"name": " "}, "encoder name is empty"),
    ]
    for cls, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            cls(**kwargs)
    assert ResourcesConfig(generator_max_restarts=-1).generator_max_restarts == -1  # Ray's "always"


@dataclass(frozen=True)
class Knobs:
    """Knobs of the test tree.

    A second paragraph, not in --help."""

    mode: Literal["fast", "slow"] = "fast"
    """How to run: ``"fast"`` or ``"slow"``, see :func:`ray_credit.config.parse_config`."""
    precision: Literal["bf16", "fp16"] | None = None
    """Mixed precision (:data:`PRECISIONS`; :class:`~ray_credit.config.InputError`)."""
    triple: tuple[int, int, int] = (1, 2, 3)
    """Three sizes."""
    mixed: tuple[int, str] = (1, "a")
    """A count and a name."""
    names: tuple[str, ...] = ("x",)
    """Any number of names (:meth:`title <a.b.c>`)."""

    def __post_init__(self):
        check_fields(self)


@dataclass(frozen=True)
class Tree:
    """The test tree."""

    name: str = "run"
    """Run name."""
    knobs: Knobs = field(default_factory=Knobs)
    inner: Inner = field(default_factory=Inner)


def _help(cls, capsys) -> str:
    with pytest.raises(SystemExit):
        parse_config(cls, ["--help"])
    return capsys.readouterr().out


def test_help_groups_flags_by_section_under_the_class_docstring(capsys):
    text = _help(Tree, capsys)
    titles = re.findall(r"^(\S+):\n", text, flags=re.M)
    assert titles == ["options", "run", "knobs", "inner"], titles
    # the first paragraph of the section class's docstring, then that section's flags only
    knobs = text.split("\nknobs:\n", 1)[1].split("\ninner:\n", 1)[0]
    assert knobs.startswith("  Knobs of the test tree.\n\n  --knobs.mode")
    assert "second paragraph" not in text and "--inner." not in knobs
    assert "--name" in text.split("\nrun:\n", 1)[1].split("\nknobs:\n")[0]
    # a section class without a docstring (Inner) gets a bare title, not its signature
    assert "Inner(" not in text


def test_help_shows_choices_and_tuple_arity(capsys):
    text = " ".join(_help(Tree, capsys).split())
    assert "--knobs.mode {fast,slow}" in text
    assert "--knobs.precision {bf16,fp16}|none" in text
    assert "--inner.betas A,B Adam betas." in text
    assert "--knobs.triple A,B,C" in text and "--knobs.mixed A,B " in text
    assert "--knobs.names A,B,... " in text


def test_help_has_no_rest_markup(capsys):
    text = " ".join(_help(Tree, capsys).split())
    assert 'How to run: "fast" or "slow", see ray_credit.config.parse_config.' in text
    assert "Mixed precision (PRECISIONS; InputError)." in text  # ~a.B: the last part
    assert "Any number of names (title)." in text
    assert "``" not in text and not re.search(r":[a-z]+:`", text)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--knobs.mode", "medium"], r"--knobs.mode: knobs.mode must be one of \['fast', 'slow'\], "
         r"got 'medium'"),
        (["--knobs.precision", "int8"], r"--knobs.precision: knobs.precision must be one of "
         r"\['bf16', 'fp16'\] or none, got 'int8'"),
        (["--knobs.triple", "1,2"], r"--knobs.triple: knobs.triple takes 3 values \(A,B,C\)"),
        (["--knobs.mixed", "x,a"], r"knobs.mixed takes an integer, got 'x'"),
    ],
)  # fmt: skip
def test_a_value_outside_the_choices_names_the_flag_and_the_choices(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_config(Tree, argv)
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_choices_hold_for_yaml_flags_and_constructors_alike(tmp_path, capsys):
    cfg = parse_config(Tree, ["--knobs.precision", "fp16", "--knobs.mixed", "2,b"])
    assert cfg.knobs.precision == "fp16" and cfg.knobs.mixed == (2, "b")
    assert parse_config(Tree, ["--knobs.precision", "none"]).knobs.precision is None
    file = tmp_path / "c.yaml"
    file.write_text("knobs: {mode: medium}\n")
    with pytest.raises(SystemExit):
        parse_config(Tree, ["--config", str(file)])
    err = capsys.readouterr().err
    assert f"--config {file}: knobs.mode must be one of ['fast', 'slow'], got 'medium'" in err
    with pytest.raises(ValueError, match=r"Knobs.mode must be one of \['fast', 'slow'\], got 'x'"):
        Knobs(mode="x")
    with pytest.raises(
        ValueError, match=r"Knobs.precision must be one of \['bf16', 'fp16'\] or None"
    ):
        Knobs(precision="int8")
    with pytest.raises(TypeError, match="Knobs.triple takes 3 values"):
        Knobs(triple=(1, 2))


# Every setting of the pipelines whose values are a fixed set, with its choices in --help.
ENUMERATED = {
    "wandb.mode": "{offline,online,disabled}",
    "generator.action_style": "{tags,tool_call}",
    "generator.reward": "{em,subem,f1}",
    "generator.backend": "{transformers,vllm}",
    "generator.dtype": "{float32,bfloat16,float16,auto,native}",
    "learner.lr_schedule": "{constant,linear,cosine}",
    "learner.kl_kind": "{k1,abs,k2,k3,kl,mse,low_var_kl,k1+,abs+,k2+,k3+,kl+,mse+,low_var_kl+}",
    "learner.off_policy": "{none,tis,decoupled}",
    "learner.dtype": "{float32,bfloat16,float16,auto}",
    "learner.autocast": "{auto,bfloat16,float16}|none",
    "learner.loss.agg_mode": "{token-mean,seq-mean-token-sum,seq-mean-token-mean,"
    "seq-mean-token-sum-norm}",
    "learner.loss.ratio_level": "{token,turn}",
    "pipeline.weight_sync": "{object_store,nccl,gloo}",
    "resources.learner_strategy": "{ddp,fsdp}",
    "warm_start.autocast": "{auto,bfloat16,float16}|none",
    "judge.backend": "{evidence,hf,openai}",
}


def test_every_enumerated_pipeline_setting_shows_its_choices():
    from ray_credit.config import _leaves, _metavar
    from ray_credit.pipeline.configs import JudgeConfig, RunConfig

    metavars = {name: _metavar(kind) for name, kind, _d, _doc in _leaves(RunConfig)}
    metavars |= {f"judge.{n}": _metavar(k) for n, k, _d, _doc in _leaves(JudgeConfig)}
    assert {name: metavars[name] for name in ENUMERATED} == ENUMERATED
    assert metavars["learner.betas"] == "A,B"


def test_the_module_constants_are_the_literals_choices():
    """One list per setting: the constants the code checks with are the fields' choices."""
    from ray_credit.actors import generator, judge, learner
    from ray_credit.config import _hints
    from ray_credit.estimators import _group, tspo
    from ray_credit.losses import AGG_MODES, PolicyLossConfig
    from ray_credit.models import DTYPES, GENERATOR_DTYPES
    from ray_credit.pipeline.configs import JudgeConfig

    pairs = [
        (AGG_MODES, PolicyLossConfig, "agg_mode"),
        (DTYPES, learner.LearnerConfig, "dtype"),
        (GENERATOR_DTYPES, generator.GeneratorConfig, "dtype"),
        (learner.OFF_POLICY, learner.LearnerConfig, "off_policy"),
        (generator.BACKENDS, generator.GeneratorConfig, "backend"),
        (tuple(generator._REWARDS), generator.GeneratorConfig, "reward"),
        (judge.BACKENDS, JudgeConfig, "backend"),
        (_group.SINGLETON_POLICIES, _group.GRPOKnobs, "singleton_policy"),
        (tspo.PADDINGS, tspo.TSPOConfig, "padding"),
    ]
    for constant, cls, name in pairs:
        assert typing.get_args(_hints(cls)[name]) == constant, (cls, name)


def test_wandb_takes_its_mode_alone_or_its_project_entity_group_and_tags(tmp_path):
    """``--wandb disabled`` and ``wandb: online`` in YAML set the mode (the shorthand);
    the project, entity, group and tags are settings of their own."""
    from ray_credit.pipeline.configs import RunConfig

    cfg = parse_config(RunConfig, ["--wandb", "disabled"])
    assert cfg.wandb.mode == "disabled" and cfg.wandb.project == "ray_credit"
    file = tmp_path / "run.yaml"
    file.write_text("wandb: online\n")
    cfg = parse_config(RunConfig, ["--config", str(file), "--wandb.project", "search-agents",
                                   "--wandb.entity", "lab", "--wandb.group", "tspo-3b",
                                   "--wandb.tags", "tspo,nq"])  # fmt: skip
    assert (cfg.wandb.mode, cfg.wandb.project, cfg.wandb.entity, cfg.wandb.group) == (
        "online",
        "search-agents",
        "lab",
        "tspo-3b",
    )
    assert cfg.wandb.tags == ("tspo", "nq")
    file.write_text("wandb:\n  mode: disabled\n  group: seeds\n")
    cfg = parse_config(RunConfig, ["--config", str(file)])
    assert (cfg.wandb.mode, cfg.wandb.group) == ("disabled", "seeds")
    with pytest.raises(SystemExit):
        parse_config(RunConfig, ["--wandb", "loud"])
    with pytest.raises(ValueError, match="wandb.project must name a project"):
        replace_path(RunConfig(), "wandb.project", " ")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--wandb.project", "team/proj"], "wandb.project='team/proj': a project name cannot "
         "hold '/'; for project 'proj' of team 'team' give --wandb.entity team --wandb.project "
         "proj"),
        (["--wandb.project", "a:b?", "--wandb.entity", "lab"], r"wandb.project='a:b\?' holds ':', "
         r"'\?', which wandb does not take in a project name \(/ \\ # \? % :\); use '-' or '_'"),
        (["--wandb.project", "p" * 129], "wandb.project is 129 characters; wandb takes at most "
         "128"),
        (["--wandb.entity", "my team"], "wandb.entity='my team': a wandb user or team name has no "
         "spaces"),
        (["--wandb.entity", "lab#1"], "wandb.entity='lab#1' holds '#'"),
        (["--wandb.entity", "e" * 129], "wandb.entity is 129 characters"),
        (["--wandb.group", "g" * 129], "wandb.group is 129 characters; wandb takes a group of 1 "
         "to 128"),
        (["--wandb.tags", "t" * 65], "is not a tag wandb takes"),
        (["--name", "n" * 129], "name is 129 characters, and it names the wandb run too, which "
         r"takes at most 128; give a shorter --name \(or --wandb disabled\)"),
    ],
)  # fmt: skip
def test_wandb_names_are_held_to_wandbs_rules_before_ray(argv, message, capsys):
    """What wandb.init would refuse after the retriever is up (its client's rules for a
    project, the server's lengths), refused with the settings, naming the fix."""
    from ray_credit.pipeline.configs import RunConfig

    with pytest.raises(SystemExit):
        parse_config(RunConfig, argv)
    last = capsys.readouterr().err.splitlines()[-1]
    assert re.search(message, last), last
    # a long name is a folder name still, when no wandb run is made
    assert parse_config(RunConfig, ["--name", "n" * 129, "--wandb", "disabled"]).name == "n" * 129


def test_the_logger_opens_wandb_with_the_runs_project_entity_group_and_tags(tmp_path, monkeypatch):
    import sys
    import types

    from ray_credit.pipeline.configs import RunConfig, WandbConfig
    from ray_credit.pipeline.outputs import Logger

    seen = {}

    class _Run:
        id = "abc"
        settings = types.SimpleNamespace(sync_dir=str(tmp_path))

    fake = types.SimpleNamespace(
        init=lambda **kw: seen.update(kw) or _Run(), Settings=lambda **kw: kw
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = RunConfig(wandb=WandbConfig(project="p", entity="e", group="g", tags=("a", "b")))
    Logger(cfg, tmp_path).file.close()
    assert (seen["project"], seen["entity"], seen["group"], seen["tags"]) == (
        "p",
        "e",
        "g",
        ["a", "b"],
    )
    assert seen["mode"] == "offline"
