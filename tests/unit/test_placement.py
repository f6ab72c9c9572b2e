"""Where a run's actors go, computed before any starts: the shipped configs placed on the
nodes they are written for, refusals with the arithmetic, GPU sharing, storage checks."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml

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
    assert (cfg.generator.group_size, cfg.generator.topk, cfg.generator.max_turns) == (5, 3, 5)
    assert not cfg.warm_start.enabled and cfg.pipeline.stratify_by is None
    assert cfg.learner.lr == 1e-6 and cfg.learner.kl_coef == 1e-3
    placement = _placed(cfg, "tspo", EIGHT_GPUS)
    learner = sorted(g for i in range(4) for g, _ in _gpus(placement, f"learner {i}"))
    generators = sorted(g for i in range(4) for g, _ in _gpus(placement, f"generator {i}"))
    assert learner == [0, 1, 2, 3] and generators == [4, 5, 6, 7]  # one GPU each...
    for i in range(8):  # ...with the index slice beside each
        assert _gpus(placement, f"index slice {i}") == [(i, 0.1)]
    assert _gpus(placement, "retriever") == []
    assert not any(a.name.startswith("evaluation") for a in placement.asks)
    assert placement.peak["GPU"][0] == 8
    table = placement.table()
    assert "generator 3" in table and "most held at once" in table and "8 GPU" in table
    # the same on a local Ray of 8 logical GPUs: the demand the script starts it with
    demand = resource_demand(cfg, make_plan(cfg, "tspo", QUESTIONS))
    assert demand["GPU"] == 8 and demand["CPU"] == 88  # 16 + 4 x 8 + 4 x 8 + 8 slices x 1


def test_every_pipeline_places_search_r1_yaml_on_8_gpus_the_scorer_sharing_when_asked():
    from tests.unit.test_pipeline_scripts import PIPELINES

    for method, cls in PIPELINES.items():
        cfg = _config(method, cls, "--config", str(CONFIGS / "search_r1.yaml"))
        if method in ("igpo", "a2tgpo"):  # the info-gain scorer: a ninth GPU of its own...
            with pytest.raises(PlacementError) as err:
                _placed(cfg, method, EIGHT_GPUS)
            message = str(err.value)
            assert (
                "needs 9 GPU at once: 4 learners x 0.9 + 1 info-gain scorer x 1 + 4 "
                "generators x 0.9 + 8 index slices x 0.1 = 9"
            ) in message
            assert "the nodes have 8" in message and "--resources.scorer_gpus 0.25" in message
            # ...or a quarter of generator 0's
            cfg = _config(method, cls, "--config", str(CONFIGS / "search_r1.yaml"),
                          "--resources.scorer_gpus", "0.25")  # fmt: skip
            placement = _placed(cfg, method, EIGHT_GPUS)
            ((gpu, share),) = _gpus(placement, "info-gain scorer")
            assert share == 0.25 and _gpus(placement, "index slice 4") == [(gpu, 0.1)]
            assert _gpus(placement, "generator 0") == [(gpu, pytest.approx(0.65))]
        else:
            placement = _placed(cfg, method, EIGHT_GPUS)
        assert placement.peak["GPU"][0] == 8, method


def test_an_evaluation_generator_of_its_own_runs_only_when_trainings_are_not_up():
    cfg = _config("tspo", "TSPORun", "--config", str(CONFIGS / "search_r1.yaml"),
                  "--eval.generators", "own", "--resources.retriever_gpu_share", "0")  # fmt: skip
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
    with pytest.raises(PlacementError, match=r"needs 8 GPU at once: 4 learners x 0.9 \+ 4 "
                       r"generators x 0.9 \+ 8 index slices x 0.1 = 8; the nodes have 4"):  # fmt: skip
        _placed(cfg, "tspo", [Node("this machine", 96, 4)])
    with pytest.raises(PlacementError, match="needs 88 CPU at once.*the nodes have 32.*local_cpus"):
        _placed(cfg, "tspo", [Node("this machine", 32, 8)])
    # two nodes of 4 GPUs hold 4 learner workers and 4 generators...
    two = [Node("a", 16, 4), Node("b", 16, 4)]
    cfg = _config("tspo", "TSPORun", "--config", str(CONFIGS / "search_r1.yaml"),
                  "--resources.retriever_cpus", "1", "--resources.learner_cpus", "4",
                  "--resources.generator_cpus", "2", "--resources.retriever_gpu_share", "0")  # fmt: skip
    placement = _placed(cfg, "tspo", two)
    assert placement.peak["GPU"][0] == 8 and placement.peak["CPU"][0] == 25
    cfg = _config("tspo", "TSPORun", "--config", str(CONFIGS / "search_r1.yaml"),
                  "--resources.retriever_cpus", "3", "--resources.learner_cpus", "2",
                  "--resources.generator_cpus", "5", "--resources.retriever_gpu_share", "0")  # fmt: skip
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


@pytest.mark.parametrize(
    ("method", "argv", "message"),
    [
        ("tspo", ["--generator.vllm.tensor_parallel_size", "1", "--resources.generator_gpus", "2"],
         "resources.generator_gpus=2 gives each generator 2 GPUs, but its vLLM engine runs on one "
         r"\(generator.vllm.tensor_parallel_size=1\).*set --resources.generator_gpus 1, or "
         "--generator.vllm.tensor_parallel_size 2"),
        ("tspo", ["--resources.generator_gpus", "1.5"], "generator_gpus=1.5: Ray gives a share of "
         "one GPU"),
        ("tspo", ["--generator.backend", "transformers", "--resources.generator_gpus", "2"],
         "a transformers generator computes on one device: the others would be held and never "
         "used; set --resources.generator_gpus 1"),
        ("tspo", ["--generator.backend", "transformers", "--generator.vllm.tensor_parallel_size",
                  "2", "--resources.generator_gpus", "2"],
         "tensor_parallel_size=2 is a setting of vLLM's engine, and generator.backend is "
         "'transformers'"),
        ("tspo", ["--resources.generator_gpus", "0.5"], "gives each generator 0.5 of a GPU, but "
         "its vLLM engine takes generator.vllm.gpu_memory_utilization=0.9 of the GPU's memory.*"
         "--generator.vllm.gpu_memory_utilization 0.5 or less"),
        ("igpo", ["--resources.scorer_gpus", "2"], "resources.scorer_gpus=2: the info-gain scorer "
         "is one model on one device, so 1 of its GPUs would be held and never used"),
        ("tspo", ["--resources.learner_gpus", "0.5"], "learner_gpus=0.5 is the GPU share of a "
         "learner replica that trains on GPUs, but resources.use_gpu is false"),
        ("tspo", ["--retriever.url", "http://127.0.0.1:9/retrieve", "--resources.retriever_gpus",
                  "1"], "resources.retriever_gpus=1 is for the retriever actors a run builds, and "
         "retriever.url=.* searches a server instead"),
        ("tspo", ["--resources.retriever_gpus", "2", "--retriever.index.use_gpu", "false"],
         r"retriever_gpus=2: a retriever's encoder runs on one GPU, and its index on none "
         r"\(retriever.index.use_gpu is false\)"),
        ("tspo", ["--resources.retriever_gpus", "2", "--retriever.index.gpu_devices", "0,3"],
         r"gpu_devices='0,3' names device 3, but each retriever actor sees only the 2 GPU\(s\)"),
        ("tspo", ["--resources.retriever_gpus", "3", "--retriever.index.gpu_devices", "1"],
         r"and the encoder \(device 0\) use 2 of the 3 GPUs.*--resources.retriever_gpus 2"),
        ("tspo", ["--resources.retriever_replicas", "3", "--resources.num_generators", "2"],
         r"retriever_replicas=3 with resources.num_generators=2: generator i searches replica i "
         r"mod 3, so 1 replica\(s\) would each load the index .*--resources.retriever_replicas 2 "
         "or fewer"),
    ],
)  # fmt: skip
def test_a_resource_share_no_actor_can_use_is_refused_with_the_flag(method, argv, message, capsys):
    """Ray holds what an actor asks for away from every other actor: a GPU a generator's
    engine, the scorer or the retriever does not compute on is refused before Ray starts,
    with the flag and what to set, and so is a share of a GPU a vLLM engine would overrun."""
    cls = {"tspo": "TSPORun", "igpo": "IGPORun"}[method]
    with pytest.raises(SystemExit) as exit_:
        _config(method, cls, *argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and re.search(message, err.splitlines()[-1]), err


def test_the_scorer_asking_a_tensor_parallel_generators_gpus_is_refused():
    """resources.scorer_gpus unset takes a generator's GPUs: two, beside generators whose
    engines span two, of which the one-device scorer would use one."""
    argv = ["--generator.vllm.tensor_parallel_size", "2", "--resources.generator_gpus", "2"]
    cfg = _config("igpo", "IGPORun", *argv)
    with pytest.raises(InputError, match="scorer asks a generator's 2 GPUs .* give "
                       r"--resources.scorer_gpus 1 \(or a share below 1\)"):  # fmt: skip
        _placed(cfg, "igpo", EIGHT_GPUS)
    placement = _placed(_config("igpo", "IGPORun", *argv, "--resources.scorer_gpus", "1"), "igpo",
                        EIGHT_GPUS)  # fmt: skip
    assert len(_gpus(placement, "info-gain scorer")) == 1
    assert len(_gpus(placement, "generator 0")) == 2
    # a run without a scorer has no use for its GPUs
    with pytest.raises(InputError, match="resources.scorer_gpus=0.25 is for the info-gain scorer "
                       "of a run that has one .*this run has none"):  # fmt: skip
        _placed(_config("tspo", "TSPORun", "--resources.scorer_gpus", "0.25"), "tspo", EIGHT_GPUS)


def _cluster_yaml(tmp_path, change=None, text=None) -> str:
    """cluster.local.yaml with ``change`` applied to its data (or ``text`` instead)."""
    file = tmp_path / "cluster.yaml"
    if text is None:
        config = yaml.safe_load((ROOT / "cluster.local.yaml").read_text())
        change(config)
        text = yaml.safe_dump(config)
    file.write_text(text)
    return str(file)


def _types(config):
    return config["available_node_types"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: _types(c)["generator_gpu"]["resources"].update(CPU="many"),
         "available_node_types.generator_gpu.resources.CPU: expected a number, got 'many'"),
        (lambda c: c.update(max_workers="ten"),
         "max_workers: expected a whole number of nodes >= 0, got 'ten'"),
        (lambda c: c.update(available_node_types={}), "available_node_types is empty; list the "
         "head's node type and the workers'"),
        (lambda c: c.pop("head_node_type"), "head_node_type is missing"),
        (lambda c: c.update(head_node_type="head"), "head_node_type 'head' is not one of "
         r"available_node_types \(generator_gpu, learner_gpu, ray.head.default, service_cpu\)"),
        (lambda c: _types(c)["learner_gpu"].update(max_workers=-1),
         "available_node_types.learner_gpu.max_workers: expected a whole number of nodes >= 0, "
         "got -1"),
        (lambda c: _types(c)["generator_gpu"].update(min_workers=3),
         "available_node_types.generator_gpu: min_workers 3 is above max_workers 2"),
        (lambda c: c.update(available_node_types=["generator_gpu"]), "available_node_types: "
         "expected a mapping of node type names .*, got a list"),
        (lambda c: _types(c).update(service_cpu="big"),
         "available_node_types.service_cpu: expected a mapping .*, got a string"),
        (lambda c: _types(c)["service_cpu"].update(resources=[2]),
         "available_node_types.service_cpu.resources: expected a mapping of resource names to "
         "numbers"),
        (lambda c: _types(c)["generator_gpu"]["resources"].update(GPU=True),
         "available_node_types.generator_gpu.resources.GPU: expected a number, got True"),
        (lambda c: _types(c)["generator_gpu"]["resources"].update(GPU=0.5),
         r"available_node_types.generator_gpu.resources.GPU: expected a whole number >= 0 "
         r"\(Ray's cluster schema takes no fractions\), got 0.5"),
        (lambda c: (c.pop("max_workers"), _types(c)["learner_gpu"].pop("max_workers")),
         "available_node_types.learner_gpu has no max_workers and the file no global max_workers"),
        (lambda c: _types(c)["generator_gpu"].pop("resources"),
         r"available_node_types.generator_gpu gives no resources; Ray fills them in from the "
         r"instance type only once such a node starts, too late to place the run against this "
         r"file: give the node's CPUs and GPUs"),
        (lambda c: _types(c)["learner_gpu"].update(resources={"GPU": 2, "learner": 2}),
         "available_node_types.learner_gpu has no CPU in its resources; Ray fills them in"),
        (lambda c: (c.update(max_workers=1), _types(c)["generator_gpu"].update(min_workers=2)),
         r"max_workers 1 is below the node types' min_workers together \(2\)"),
    ],
)  # fmt: skip
def test_a_cluster_yaml_is_checked_naming_the_file_the_node_type_and_the_key(
    tmp_path, change, message
):
    path = _cluster_yaml(tmp_path, change)
    with pytest.raises(InputError) as err:
        nodes_of_cluster_yaml(path)
    assert re.fullmatch(f"resources.cluster_config {re.escape(path)}: {message}.*", str(err.value))


def test_a_cluster_yaml_that_is_no_mapping_or_no_yaml_is_named(tmp_path):
    from ray_credit.config import InputFileNotFoundError

    for text, says in (("- head\n- workers\n", ": the top level is a list; give a cluster "
                        "launcher YAML"), ("", ": the file is empty"),
                       ("max_workers: [1\n", r":2:1: not a readable YAML file: expected ',' or "
                        r"'\]', but got '<stream end>' \(while parsing a flow sequence that starts "
                        r"at line 1, column 14\)")):  # fmt: skip
        path = _cluster_yaml(tmp_path, text=text)
        with pytest.raises(InputError, match=f"^resources.cluster_config {re.escape(path)}{says}"):
            nodes_of_cluster_yaml(path)
    with pytest.raises(InputFileNotFoundError, match="cluster_config 'missing.yaml': no such file"):
        nodes_of_cluster_yaml("missing.yaml")
    with pytest.raises(InputFileNotFoundError, match=r"cluster_config '.*': a folder, not a file"):
        nodes_of_cluster_yaml(str(tmp_path))


def test_a_cluster_yaml_is_read_as_ray_fills_it_in_and_its_max_workers_holds(tmp_path):
    """A worker type without max_workers may start the file's max_workers (Ray's fill-in);
    workers of the head's type count; and a plan that needs more workers at once than the
    file's max_workers is refused, though each type alone has room."""

    def change(config):
        del _types(config)["generator_gpu"]["max_workers"]
        _types(config)["ray.head.default"]["max_workers"] = 1

    nodes = nodes_of_cluster_yaml(_cluster_yaml(tmp_path, change))
    names = [n.name for n in nodes]
    assert names[0] == "ray.head.default#0" and "ray.head.default#1" in names
    assert sum(name.startswith("generator_gpu") for name in names) == 6  # the file's 6
    cfg = _config("tspo", "TSPORun", "--config", str(CONFIGS / "local_cluster.yaml"),
                  "--resources.num_generators", "4", "--resources.generator_gpus", "1",
                  "--generator.backend", "transformers")  # fmt: skip
    _placed(cfg, "tspo", nodes)  # 4 generator nodes, a learner's, a service's: 6
    few = nodes_of_cluster_yaml(_cluster_yaml(tmp_path, lambda c: c.update(max_workers=3)))
    with pytest.raises(PlacementError, match="needs 4 worker nodes at once .*the cluster's "
                       "max_workers lets the autoscaler run 3"):  # fmt: skip
        _placed(_config("tspo", "TSPORun", "--config", str(CONFIGS / "local_cluster.yaml"),
                        "--resources.num_generators", "2", "--resources.generator_gpus", "1",
                        "--generator.backend", "transformers"), "tspo", few)  # fmt: skip


def test_the_eval_scripts_actors_are_placed_before_any_starts():
    """pipelines/eval.py's retriever and generators are placed as a training run's are (a
    local Ray's plan that cannot fit is refused before Ray starts; on a cluster, against
    resources.cluster_config); they used to be started unplaced, to wait for GPUs forever."""
    from ray_credit.actors.generator import GeneratorConfig
    from ray_credit.pipeline.cli import run_config_class
    from ray_credit.pipeline.configs import ResourcesConfig
    from ray_credit.pipeline.placement import evaluation_asks

    eval_run = run_config_class(ROOT / "pipelines" / "eval.py", "EvalRun")
    cfg = eval_run(generator=GeneratorConfig(backend="transformers"),
                   resources=ResourcesConfig(num_generators=2, generator_gpus=1.0))  # fmt: skip
    asks = evaluation_asks(cfg)
    assert [a.name for a in asks] == ["retriever", "generator 0", "generator 1"]
    with pytest.raises(PlacementError, match=r"the evaluation needs 2 GPU at once: 2 generators "
                       r"x 1 = 2; the nodes have 1"):  # fmt: skip
        place(asks, [Node("this machine", 8, 1)], "a local Ray")
    placement = place(asks, [Node("this machine", 8, 2)], "a local Ray")
    assert sorted(g for i in range(2) for g, _ in _gpus(placement, f"generator {i}")) == [0, 1]
    assert "the whole run" in placement.table()
