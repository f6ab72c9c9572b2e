"""``resources.retriever_gpu_share``: a flat index in slices beside the learners and the
generators, one per GPU. Its placement (each slice on its host's GPU, the host asking the
rest), what a run that cannot hold it is told before Ray starts, and its memory."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ray_credit.pipeline.cli import run_config_class
from ray_credit.pipeline.configs import load_config
from ray_credit.pipeline.memory import GB, estimate, model_shape, report_memory, slice_bytes
from ray_credit.pipeline.placement import (
    EVALUATION,
    Node,
    evaluation_asks,
    place,
    run_asks,
    slice_hosts,
)

ROOT = Path(__file__).resolve().parents[2]
SEARCH_R1 = str(ROOT / "pipelines/configs/search_r1.yaml")
WIKI_18 = (21_015_324, 768)  # wiki-18's passages, e5-base-v2's dimension
QWEN_3B = {  # Qwen2.5-3B-Instruct's config.json, the fields that size it
    "hidden_size": 2048, "intermediate_size": 11008, "num_attention_heads": 16,
    "num_hidden_layers": 36, "num_key_value_heads": 2, "vocab_size": 151936,
    "tie_word_embeddings": True,
}  # fmt: skip


def _cfg(*argv, script="tspo", cls="TSPORun"):
    path = ROOT / "pipelines" / f"{script}.py"
    sys_argv, sys.argv = sys.argv, [str(path)]
    try:
        return load_config(run_config_class(path, cls), script, list(argv))
    finally:
        sys.argv = sys_argv


def _refused(capsys, *argv, script="tspo", cls="TSPORun") -> str:
    with pytest.raises(SystemExit) as exit_:
        _cfg(*argv, script=script, cls=cls)
    assert exit_.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


def test_each_slice_goes_on_its_hosts_gpu_which_asks_the_rest():
    cfg = _cfg("--config", SEARCH_R1, "--resources.retriever_gpu_share", "0.1")
    hosts = slice_hosts(cfg)
    assert hosts == [*(f"learner {i}" for i in range(4)), *(f"generator {i}" for i in range(4))]
    asks = run_asks(cfg, set())
    placement = place(asks, [Node("node", 96, 8)], "test")
    seen = set()
    for i, host in enumerate(hosts):
        ((gpu, rest),) = placement.spots[host].gpus
        ((slice_gpu, share),) = placement.spots[f"index slice {i}"].gpus
        assert slice_gpu == gpu and rest == pytest.approx(0.9) and share == pytest.approx(0.1)
        seen.add(gpu)
    assert seen == set(range(8))
    # held from the evaluation before training to the one after: the bundles are reserved
    # before the retriever starts, and kept
    assert {a.phases for a in asks if a.name.startswith("index slice")} == {
        ("eval_before", "training", "eval_after")
    }
    assert placement.peak["GPU"][0] == pytest.approx(8)
    assert placement.peak["CPU"][0] == pytest.approx(16 + 8 * 8 + 8 * 1)  # + a CPU a slice
    table = placement.table()
    assert "index slice 7" in table and "7 (0.1)" in table and "0 (0.9)" in table


def test_without_a_share_nothing_changes():
    cfg = _cfg("--config", SEARCH_R1, "--resources.retriever_gpu_share", "0")
    assert slice_hosts(cfg) == []
    assert not any(a.name.startswith("index slice") for a in run_asks(cfg, set()))
    assert all(a.gpus == 1 for a in run_asks(cfg, set()) if a.name.startswith("learner"))


def test_an_evaluation_own_generator_takes_a_whole_gpu_the_shared_ones_leave_none_for():
    cfg = _cfg("--config", SEARCH_R1, "--resources.retriever_gpu_share", "0.1",
               "--eval.generators", "own")  # fmt: skip
    from ray_credit.pipeline.placement import PlacementError

    with pytest.raises(PlacementError, match="evaluation before training needs 9 GPU at once"):
        place(run_asks(cfg, set()), [Node("node", 96, 8)], "test")
    fewer = _cfg("--config", SEARCH_R1, "--resources.retriever_gpu_share", "0.1",
                 "--eval.generators", "own", "--resources.num_generators", "3")  # fmt: skip
    placement = place(run_asks(fewer, set()), [Node("node", 96, 8)], "test")
    assert len(slice_hosts(fewer)) == 7 and "index slice 6" in placement.spots


def test_eval_py_puts_the_slices_beside_its_generators():
    cfg = _cfg("--config", SEARCH_R1, "--resources.retriever_gpu_share", "0.1")
    asks = evaluation_asks(cfg)
    names = [a.name for a in asks]
    assert [n for n in names if n.startswith("index slice")] == [f"index slice {i}" for i in
                                                                 range(4)]  # fmt: skip
    assert all(a.phases == (EVALUATION,) for a in asks)
    placement = place(asks, [Node("node", 64, 4)], "test")
    for i in range(4):
        assert (
            placement.spots[f"index slice {i}"].gpus[0][0]
            == (placement.spots[f"generator {i}"].gpus[0][0])
        )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--resources.retriever_gpu_share", "1"], r"must lie in \[0, 1\)"),
        (["--resources.retriever_gpu_share", "-0.1"], r"must lie in \[0, 1\)"),
        (["--retriever.index.kind", "hnsw"],
         r"serves a flat index in slices, and retriever.index.kind is 'hnsw'"),
        (["--resources.use_gpu", "false"], "give --resources.use_gpu true"),
        (["--resources.learner_gpus", "0.5", "--resources.learner_workers", "1"],
         "resources.learner_gpus is 0.5: set it to 1"),
        (["--resources.retriever_replicas", "2"], "one retriever searches the slices"),
        (["--retriever.index.use_gpu", "true"], "drop one of them"),
        (["--warm_start.enabled", "true"], "warm-start in a run without the share"),
        (["--retriever.url", "http://host:8000/retrieve"],
         "resources.retriever_gpu_share=0.1 is for the retriever actors a run builds"),
    ],
)  # fmt: skip
def test_a_share_the_run_cannot_hold_is_refused_with_what_to_set(capsys, argv, message):
    import re

    line = _refused(capsys, "--config", SEARCH_R1, "--resources.retriever_gpu_share", "0.1",
                    *argv)  # fmt: skip
    assert re.search(message, line), line


def test_the_scorer_shares_generator_0s_gpu_with_its_slice():
    cfg = _cfg("--config", SEARCH_R1, "--resources.scorer_gpus", "0.25", script="igpo",
               cls="IGPORun")  # fmt: skip
    placement = place(run_asks(cfg, {"scorer"}), [Node("node", 96, 8)], "test")
    ((gpu, rest),) = placement.spots["generator 0"].gpus
    assert placement.spots["info-gain scorer"].gpus == ((gpu, 0.25),)
    assert placement.spots["index slice 4"].gpus == ((gpu, 0.1),)
    assert rest == pytest.approx(0.65) and placement.peak["GPU"][0] == 8


@pytest.fixture
def qwen(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_3B))
    return str(tmp_path)


def test_every_gpu_counts_its_slice_of_wiki_18(qwen, capfd):
    cfg = _cfg("--config", SEARCH_R1, "--model", qwen, "--resources.retriever_gpu_share", "0.1",
               "--resources.gpu_memory_gb", "80")  # fmt: skip
    import torch

    from ray_credit.actors.flat_slices import FlatSlice

    rows = -(-WIKI_18[0] // 8)
    search = FlatSlice.workspace_bytes(256, 3, dim=768, dtype=torch.float16)  # a batch's
    assert slice_bytes(cfg, WIKI_18) == pytest.approx(rows * 768 * 2 + search)
    assert 0.2 * GB < search < 0.3 * GB
    learner, generator = estimate(cfg, model_shape(qwen), 80.0, (), WIKI_18)
    assert learner["parts"]["index slice"] == pytest.approx(slice_bytes(cfg, WIKI_18) / GB)
    assert 3.9 < learner["parts"]["index slice"] < 4.1  # 2.6 M rows x 768 x 2 bytes
    assert learner["total"] < 80 and generator["slice_gb"] == learner["parts"]["index slice"]
    assert report_memory(cfg, set(), WIKI_18) == []
    out = "".join(capfd.readouterr())
    assert "index slice 4.0 = 66.5 GB of 80" in out
    assert "beside it an index slice 4.0 GB" in out
    # a vLLM engine that leaves its slice no room is told the utilization that does
    greedy = _cfg("--config", SEARCH_R1, "--model", qwen, "--resources.retriever_gpu_share",
                  "0.1", "--resources.gpu_memory_gb", "80",
                  "--generator.vllm.gpu_memory_utilization", "0.97")  # fmt: skip
    (warning,) = report_memory(greedy, set(), WIKI_18)
    assert "77.6 GB" in warning and "gpu_memory_utilization 0.94 or less" in warning
    # no share: no slice anywhere
    plain = _cfg("--config", SEARCH_R1, "--model", qwen, "--resources.retriever_gpu_share", "0")
    learner, generator = estimate(plain, model_shape(qwen), 80.0, (), WIKI_18)
    assert "index slice" not in learner["parts"] and "slice_gb" not in generator
