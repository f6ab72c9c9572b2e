"""Where a run's actors go, computed before any starts: the shipped configs placed on the
nodes they are written for, refusals with the arithmetic, GPU sharing, storage checks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ray_credit.config import InputError
from ray_credit.pipeline.cli import run_config_class
from ray_credit.pipeline.configs import load_config
from ray_credit.pipeline.placement import (
    Node,
    PlacementError,
    check_storage,
    nodes_of_cluster_yaml,
    place,
    run_asks,
)
from ray_credit.pipeline.plan import make_plan
from ray_credit.pipeline.services import resource_demand

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "pipelines" / "configs"
QUESTIONS = [{"question": "q?", "golden_answers": ["a"], "supporting_doc_ids": ["d"]}]
EIGHT_GPUS = [Node("this machine", 96, 8)]


def _config(method: str, cls: str, *argv: str):
    sys_argv, sys.argv = sys.argv, [str(ROOT / "pipelines" / f"{method}.py")]
    try:
        return load_config(run_config_class(ROOT / "pipelines" / f"{method}.py", cls), method,
                           list(argv))  # fmt: skip
    finally:
        sys.argv = sys_argv


def _placed(cfg, method: str, nodes, source: str = "test"):
    plan = make_plan(cfg, method, QUESTIONS)
    return place(run_asks(cfg, plan.services), nodes, source)


def _gpus(placement, name: str) -> list[tuple[int, float]]:
    return list(placement.spots[name].gpus)


def test_search_r1_yaml_fills_one_8_gpu_node_and_evaluates_on_the_training_generators():
    cfg = _config("tspo", "TSPORun", "--config", str(CONFIGS / "search_r1.yaml"))
    assert cfg.model == "Qwen/Qwen2.5-3B-Instruct" and cfg.retriever.encoder.name == "e5-base-v2"
    assert (cfg.generator.group_size, cfg.generator.topk, cfg.generator.max_turns) == (5, 3, 3)
    assert not cfg.warm_start.enabled and cfg.pipeline.stratify_by is None
    assert cfg.learner.lr == 1e-6 and cfg.learner.kl_coef == 1e-3
    placement = _placed(cfg, "tspo", EIGHT_GPUS)
    learner = sorted(g for i in range(4) for g, _ in _gpus(placement, f"learner {i}"))
    generators = sorted(g for i in range(4) for g, _ in _gpus(placement, f"generator {i}"))
    assert learner == [0, 1, 2, 3] and generators == [4, 5, 6, 7]  # one GPU each, none shared
    assert _gpus(placement, "retriever") == []
    assert not any(a.name.startswith("evaluation") for a in placement.asks)
    assert placement.peak["GPU"][0] == 8
    table = placement.table()
    assert "generator 3" in table and "most held at once" in table and "8 GPU" in table
    # the same on a local Ray of 8 logical GPUs: the demand the script starts it with
    demand = resource_demand(cfg, make_plan(cfg, "tspo", QUESTIONS))
    assert demand["GPU"] == 8 and demand["CPU"] == 80


def test_every_pipeline_places_search_r1_yaml_on_8_gpus_the_scorer_sharing_when_asked():
    from tests.unit.test_pipeline_scripts import PIPELINES

    for method, cls in PIPELINES.items():
        cfg = _config(method, cls, "--config", str(CONFIGS / "search_r1.yaml"))
        if method in ("igpo", "a2tgpo"):  # the info-gain scorer: a ninth GPU of its own...
            with pytest.raises(PlacementError) as err:
                _placed(cfg, method, EIGHT_GPUS)
            message = str(err.value)
            assert "needs 9 GPU at once: 4 learners x 1 + 1 info-gain scorer x 1 + 4 " in message
            assert "the nodes have 8" in message and "--resources.scorer_gpus 0.25" in message
            # ...or a quarter of generator 0's
            cfg = _config(method, cls, "--config", str(CONFIGS / "search_r1.yaml"),
                          "--resources.scorer_gpus", "0.25")  # fmt: skip
            placement = _placed(cfg, method, EIGHT_GPUS)
            ((gpu, share),) = _gpus(placement, "info-gain scorer")
            assert _gpus(placement, "generator 0") == [(gpu, 0.75)] and share == 0.25
        else:
            placement = _placed(cfg, method, EIGHT_GPUS)
        assert placement.peak["GPU"][0] == 8, method


def test_an_evaluation_generator_of_its_own_runs_only_when_trainings_are_not_up():
    cfg = _config("tspo", "TSPORun", "--config", str(CONFIGS / "search_r1.yaml"),
                  "--eval.generators", "own")  # fmt: skip
    placement = _placed(cfg, "tspo", EIGHT_GPUS)
    ask = next(a for a in placement.asks if a.name == "evaluation generator")
    assert ask.phases == ("eval_before", "eval_after")
    assert "eval before, eval after" in placement.table()
    assert placement.peak["GPU"][0] == 8  # training: 4 + 4; the evaluations: 4 + 1


def test_aws_yaml_is_placed_on_the_node_types_of_cluster_yaml_and_stores_in_a_bucket():
    cfg = _config("tspo", "TSPORun", "--config", str(CONFIGS / "aws.yaml"))
    assert cfg.storage_path.startswith("s3://")
    nodes = nodes_of_cluster_yaml(str(ROOT / "cluster.yaml"))
    assert sum(n.name.startswith("generator_gpu") for n in nodes) == 8
    placement = _placed(cfg, "tspo", nodes, "cluster.yaml")
    where = {a.name: placement.nodes[placement.spots[a.name].node].name for a in placement.asks}
    assert {where[f"learner {i}"] for i in range(4)} == {"learner_gpu#0"}  # FSDP on one node
    assert len({where[f"generator {i}"] for i in range(4)}) == 4  # one GPU per g5.2xlarge
    assert where["retriever"].startswith("service_cpu")
    check_storage(placement, cfg)  # a bucket: every node reaches it
    # the same run with its checkpoints on the head's disk is refused, naming the fix
    local = _config("tspo", "TSPORun", "--config", str(CONFIGS / "aws.yaml"),
                    "--storage_path", "/tmp/runs")  # fmt: skip
    with pytest.raises(InputError, match="span 6 nodes.*--storage_path s3://BUCKET/runs"):
        check_storage(placement, local)


def test_a_plan_that_cannot_fit_is_refused_with_the_arithmetic():
    cfg = _config("tspo", "TSPORun", "--config", str(CONFIGS / "search_r1.yaml"))
    with pytest.raises(PlacementError, match=r"needs 8 GPU at once: 4 learners x 1 \+ 4 "
                       r"generators x 1 = 8; the nodes have 4"):  # fmt: skip
        _placed(cfg, "tspo", [Node("this machine", 96, 4)])
    with pytest.raises(PlacementError, match="needs 80 CPU at once.*the nodes have 32.*local_cpus"):
        _placed(cfg, "tspo", [Node("this machine", 32, 8)])
    # two nodes of 4 GPUs hold 4 learner workers and 4 generators...
    two = [Node("a", 16, 4), Node("b", 16, 4)]
    cfg = _config("tspo", "TSPORun", "--config", str(CONFIGS / "search_r1.yaml"),
                  "--resources.retriever_cpus", "1", "--resources.learner_cpus", "4",
                  "--resources.generator_cpus", "2")  # fmt: skip
    placement = _placed(cfg, "tspo", two)
    assert placement.peak["GPU"][0] == 8 and placement.peak["CPU"][0] == 25
    cfg = _config("tspo", "TSPORun", "--config", str(CONFIGS / "search_r1.yaml"),
                  "--resources.retriever_cpus", "3", "--resources.learner_cpus", "2",
                  "--resources.generator_cpus", "5")  # fmt: skip
    # ...but with 31 of 32 CPUs and 8 of 8 GPUs asked, three generators leave node a one
    # CPU beside its last GPU: the sums fit, the actors do not
    with pytest.raises(PlacementError, match="no node can hold learner 3 .*free then: a: 1 CPU"):
        _placed(cfg, "tspo", two)


def test_a_custom_resource_no_node_has_is_named():
    cfg = _config("tspo", "TSPORun", "--resources.generator_resource", "generator",
                  "--warm_start.enabled", "false")  # fmt: skip
    with pytest.raises(PlacementError, match="'generator'.*resources.\\*_resource none"):
        _placed(cfg, "tspo", [Node("this machine", 8, 0)])


def test_a_question_file_without_a_config_names_the_settings_it_gets(capfd):
    """--data.questions on the embedded demo's settings says so, and names the recipe file;
    with --config it is silent."""
    _config("tspo", "TSPORun", "--data.questions", "train.parquet", "--data.corpus", "c.jsonl")
    out = "".join(capfd.readouterr())
    assert "embedded demo's settings" in out and "pipelines/configs/search_r1.yaml" in out
    _config("tspo", "TSPORun", "--config", str(CONFIGS / "search_r1.yaml"))
    assert "embedded demo's settings" not in "".join(capfd.readouterr())
