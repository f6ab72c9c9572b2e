"""docs/search_r1.md's recipe table, pipelines/configs/search_r1.yaml and the departures a
run prints: one table, one file, the same numbers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from ray_credit.pipeline.cli import run_config_class
from ray_credit.pipeline.configs import load_config
from ray_credit.pipeline.published import SEARCH_R1, get_path, same_value, setup_departures

ROOT = Path(__file__).resolve().parents[2]
YAML = ROOT / "pipelines" / "configs" / "search_r1.yaml"


def _flat(section: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in section.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _table() -> dict[str, tuple[str, str, str]]:
    """setting -> (search_r1.yaml cell, recipe cell, source cell), code quotes removed."""
    rows = {}
    for line in (ROOT / "docs" / "search_r1.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            key, value, recipe, source = (c.strip("`") for c in cells)
            assert key not in rows, f"{key} twice in the table"
            rows[key] = (value, recipe, source)
    return rows


def _config(*argv: str):
    sys_argv, sys.argv = sys.argv, [str(ROOT / "pipelines" / "tspo.py")]
    try:
        cls = run_config_class(ROOT / "pipelines" / "tspo.py", "TSPORun")
        return load_config(cls, "tspo", ["--config", str(YAML), *argv])
    finally:
        sys.argv = sys_argv


def test_the_table_holds_every_setting_of_the_file_and_of_the_recipe():
    table, written = _table(), _flat(yaml.safe_load(YAML.read_text()))
    assert set(written) <= set(table), f"not in the table: {set(written) - set(table)}"
    assert set(SEARCH_R1.settings) <= set(table)
    cfg = _config()
    for key, (value, recipe, source) in table.items():
        got = get_path(cfg, key)
        if value == "(default)":
            assert key not in written and key in SEARCH_R1.settings, key
            assert same_value(got, SEARCH_R1.settings[key].value), (key, got)
        else:
            assert same_value(got, written[key]) or got == written[key], (key, got)
            assert same_value(yaml.safe_load(value), written[key]), (key, value)
        if recipe == "—":
            assert key not in SEARCH_R1.settings, f"{key}: the recipe has a value"
        else:
            setting = SEARCH_R1.settings[key]
            assert same_value(yaml.safe_load(recipe), setting.value), (key, recipe)
            assert source == setting.source, key


def test_what_departs_is_printed_and_nothing_else():
    cfg, table = _config(), _table()
    departing = {
        key for key, (_, recipe, _) in table.items()
        if recipe != "—" and not same_value(get_path(cfg, key), SEARCH_R1.settings[key].value)
    }  # fmt: skip
    assert departing == {"pipeline.max_staleness"}
    lines = setup_departures(cfg)
    assert [line.split(" = ")[0] for line in lines[: len(departing)]] == sorted(departing)
    assert lines[len(departing) :] == list(SEARCH_R1.notes)
    assert lines[0].startswith("pipeline.max_staleness = 1 (search-r1: 0, Search-R1's")
    changed = setup_departures(_config("--generator.max_turns", "3", "--learner.kl_coef", "0"))
    assert "generator.max_turns = 3 (search-r1: 5, Search-R1's" in changed[0]
    assert changed[1].startswith("learner.kl_coef = 0.0 (search-r1: 0.001")


def test_a_config_naming_no_published_setup_is_refused(capsys):
    with pytest.raises(SystemExit):
        _config("--reproduces", "search-r2")
    assert "reproduces='search-r2' names no published setup; give one of ['search-r1']" in (
        capsys.readouterr().err
    )


def test_aws_yaml_runs_the_same_recipe_kl_included():
    """cluster.yaml's config trains search_r1.yaml's recipe on A10Gs: the same departures
    (the staleness, and the notes), nothing else."""
    sys_argv, sys.argv = sys.argv, [str(ROOT / "pipelines" / "tspo.py")]
    try:
        cls = run_config_class(ROOT / "pipelines" / "tspo.py", "TSPORun")
        aws = load_config(cls, "tspo", ["--config", str(ROOT / "pipelines/configs/aws.yaml")])
    finally:
        sys.argv = sys_argv
    assert aws.reproduces == "search-r1" and aws.learner.kl_coef == 1e-3
    assert setup_departures(aws) == setup_departures(_config())
