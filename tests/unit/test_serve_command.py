"""`python -m ray_credit.serve` without Ray: its flags and help, and the inputs it refuses
(in one line) before Ray starts. The command serving requests is tests/ray/test_serve_command.py."""

from __future__ import annotations

import json
import sys

import pytest

from ray_credit.serve import ServeConfig, main


@pytest.fixture
def no_ray(monkeypatch):
    """Any `import ray` fails: what passes here needs no Ray."""
    monkeypatch.setitem(sys.modules, "ray", None)


def test_help_lists_the_flags_without_ray(no_ray, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert "Search-R1" in out and "Ctrl-C" in out
    for flag in ("--corpus", "--index_folder", "--encoder.name", "--encoder.pooling",
                 "--index.kind", "--limits.max_topk", "--host", "--port", "--num_replicas",
                 "--num_cpus", "--num_gpus"):  # fmt: skip
        assert flag in out, flag
    assert "{auto,mean,cls}" in out  # the pooling choices


def test_flags_build_the_config():
    from ray_credit.config import parse_config

    cfg = parse_config(
        ServeConfig,
        ["--corpus", "c.jsonl", "--encoder.name", "e5-base-v2", "--index.kind", "hnsw",
         "--limits.max_topk", "10", "--port", "8123", "--num_replicas", "2", "--num_gpus", "1"],
    )  # fmt: skip
    assert (cfg.corpus, cfg.encoder.name, cfg.index.kind) == ("c.jsonl", "e5-base-v2", "hnsw")
    assert (cfg.limits.max_topk, cfg.port, cfg.num_replicas, cfg.num_gpus) == (10, 8123, 2, 1.0)


@pytest.mark.parametrize(
    "setup, flags, message",
    [
        (None, [], "--corpus is required"),
        (None, ["--corpus", "{tmp}/missing.jsonl"], "missing.jsonl' does not exist"),
        ("not json\n", ["--corpus", "{tmp}/corpus.jsonl"], "corpus.jsonl:1: invalid JSON"),
        ("\n", ["--corpus", "{tmp}/corpus.jsonl"], "holds no document"),
        ("ok", ["--corpus", "{tmp}/corpus.jsonl", "--index_folder", "{tmp}/corpus.jsonl"],
         "corpus.jsonl is a file"),
        ("ok", ["--corpus", "{tmp}/corpus.jsonl", "--index_folder", "{tmp}"],
         "holds files that are not an index"),
    ],
)  # fmt: skip
def test_bad_inputs_are_one_line_before_ray(no_ray, tmp_path, setup, flags, message):
    if setup is not None:
        doc = json.dumps({"id": 1, "contents": "Title\ntext"}) + "\n"
        (tmp_path / "corpus.jsonl").write_text(doc if setup == "ok" else setup)
    with pytest.raises(SystemExit) as exit:
        main([flag.format(tmp=tmp_path) for flag in flags])
    error = str(exit.value.code)
    assert error.startswith("python -m ray_credit.serve: error: ") and message in error
    assert "\n" not in error


def test_bad_setting_is_an_argparse_error(no_ray, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--corpus", "c.jsonl", "--port", "0"])
    assert exit.value.code == 2
    assert "port must lie in [1, 65535], got 0" in capsys.readouterr().err
