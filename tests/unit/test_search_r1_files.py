"""The README's real-data command on files shaped as Search-R1 ships them, stopped where Ray
would start: the merged parquet, the gzipped corpus, the index parts refused with the
command that joins them, the joined index taken, the run placed on one node of 8 GPUs;
and a corpus above a million passages without an index refused with the ways out."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tests.search_r1_files import write_search_r1_files

ROOT = Path(__file__).resolve().parents[2]
QWEN_3B = {  # Qwen2.5-3B-Instruct's config.json, the fields that size it
    "model_type": "qwen2", "hidden_size": 2048, "intermediate_size": 11008,
    "num_attention_heads": 16, "num_hidden_layers": 36, "num_key_value_heads": 2,
    "vocab_size": 151936, "tie_word_embeddings": True,
}  # fmt: skip


class _Placed(BaseException):  # past main()'s one-line handler of errors
    """Raised where Ray would start, with what the run would place."""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_search_r1_files(tmp_path_factory.mktemp("search_r1"))


def _command(files, *extra: str) -> list[str]:
    """The README's training command on these files (the model a folder with Qwen2.5-3B's
    config, the encoder the embedded one the index was made with: nothing to download)."""
    model = files["folder"] / "qwen2.5-3b"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(QWEN_3B))
    return [
        "--config", str(ROOT / "pipelines" / "configs" / "search_r1.yaml"),
        "--data.questions", str(files["train"]),
        "--data.eval_file", str(files["test"]),
        "--data.corpus", str(files["corpus"]),
        "--retriever.index_file", str(files["folder"] / "e5_Flat.index"),
        "--model", str(model), "--retriever.encoder.name", "minilm",
        "--output_dir", str(files["folder"] / "runs"), "--wandb", "disabled",
        *extra,
    ]  # fmt: skip


def _run_until_ray(argv, monkeypatch):
    """main() of pipelines/tspo.py up to where Ray would start: the captured asks, or the
    one-line refusal (SystemExit)."""
    from ray_credit.pipeline import recipe
    from ray_credit.pipeline.cli import main, run_config_class

    def connect(cfg, demand=None, *, asks=()):
        raise _Placed(cfg, demand, list(asks))

    monkeypatch.setattr(recipe, "connect", connect)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    script = ROOT / "pipelines" / "tspo.py"
    monkeypatch.setattr(sys, "argv", [str(script)])
    main(run_config_class(script, "TSPORun"), "tspo", "", argv=argv)


def test_the_index_parts_are_refused_with_the_command_that_joins_them(files, monkeypatch):
    argv = _command(files)
    argv[argv.index("--retriever.index_file") + 1] = str(files["part_aa"])
    with pytest.raises(SystemExit) as exit_:
        _run_until_ray(argv, monkeypatch)
    folder = files["folder"]
    assert re.search(
        rf"retriever.index_file {folder}/part_aa is one part of a faiss index split for "
        rf"download \(part_aa, part_ab in {folder}\); join the parts into one file first, in "
        rf"order: cat {folder}/part_\* > {folder}/e5_Flat.index",
        str(exit_.value.code),
    ), exit_.value.code


def test_the_readme_command_on_search_r1_files_is_placed_on_8_gpus(files, monkeypatch, caplog):
    from ray_credit.pipeline.placement import Node, place

    joined = files["folder"] / "e5_Flat.index"
    joined.write_bytes(files["part_aa"].read_bytes() + files["part_ab"].read_bytes())
    with caplog.at_level("INFO", logger="ray_credit"), pytest.raises(_Placed) as placed:
        _run_until_ray(_command(files), monkeypatch)
    cfg, demand, asks = placed.value.args
    log = "\n".join(r.message for r in caplog.records)
    # the merged file as it ships: keyed by source, its own prompts, said once each
    assert "ids repeat across data sources ('train_0' at row 0 and row" in log
    assert "questions bring their own prompt (the 'prompt' column), used as given" in log
    # the recipe's departures, printed before Ray starts
    assert "note: departs from search-r1: pipeline.max_staleness = 1 (search-r1: 0" in log
    assert "note: departs from search-r1: a trajectory whose context reaches" in log
    assert "memory per GPU" in log and "learner worker (fsdp over 4, float32)" in log
    placement = place(asks, [Node("this machine", 96, 8)], "test")
    learners = sorted(g for i in range(4) for g, _ in placement.spots[f"learner {i}"].gpus)
    generators = sorted(g for i in range(4) for g, _ in placement.spots[f"generator {i}"].gpus)
    assert learners == [0, 1, 2, 3] and generators == [4, 5, 6, 7]
    # the index in 8 slices, one on each GPU beside its learner or generator
    hosts = [*(f"learner {i}" for i in range(4)), *(f"generator {i}" for i in range(4))]
    for i, host in enumerate(hosts):
        assert placement.spots[f"index slice {i}"].gpus == ((placement.spots[host].gpus[0][0],
                                                            0.1),)  # fmt: skip
    assert demand["GPU"] == 8 and cfg.retriever.index_file == str(joined)


def test_a_corpus_above_a_million_passages_without_an_index_is_refused(files, monkeypatch):
    """The threshold lowered to this corpus's size: the same refusal a 21 M passage
    wiki-18 gets, with the build's time and the ways out."""
    from ray_credit.pipeline import preflight

    monkeypatch.setattr(preflight, "BUILD_IN_RUN_DOCS", 10)
    monkeypatch.setenv("RAY_CREDIT_CACHE", str(files["folder"] / "cache"))
    argv = _command(files)
    at = argv.index("--retriever.index_file")
    del argv[at : at + 2]
    with pytest.raises(SystemExit) as exit_:
        _run_until_ray(argv, monkeypatch)
    message = str(exit_.value.code)
    assert re.search(
        r"data.corpus .*wiki-18.jsonl.gz holds \d+ passages and no index of them was found "
        r"\(in .*\): the run would embed every passage on CPUs before training starts, about "
        r"0.0 days at the 28 passages/s",
        message,
    ), message
    assert "--retriever.index_file e5_Flat.index" in message
    assert "python -m ray_credit.index build --corpus" in message
    assert "--build.workers 8 --build.worker_gpus 1, then --retriever.index_folder" in message
    # GPU workers for the run's own build: taken, and the run goes on to Ray
    with pytest.raises(_Placed):
        _run_until_ray(
            [*argv, "--retriever.build.workers", "2", "--retriever.build.worker_gpus", "1"],
            monkeypatch,
        )
