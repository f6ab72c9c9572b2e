"""The pipeline scripts' command lines: --help everywhere, bad flags named."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ray_credit.estimators.tspo import TSPOConfig
from ray_credit.pipeline.cli import run_config_class
from ray_credit.pipeline.configs import EMBEDDED_CONFIG, RunConfig

ROOT = Path(__file__).resolve().parents[2]
PIPELINES = {  # method -> its script's run config class
    "grpo": "GRPORun",
    "tspo": "TSPORun",
    "cw_grpo": "CWGRPORun",
    "search_p1": "SearchP1Run",
    "igpo": "IGPORun",
    "a2tgpo": "A2TGPORun",
    "gigpo": "GiGPORun",
}


def test_help_and_bad_flags(capsys, monkeypatch):
    """Every pipeline's --help (tspo.py as a script, the others through the same main in
    this process), and bad values refused with the flag named (exit status 2)."""
    from ray_credit.pipeline.cli import main

    monkeypatch.setenv("COLUMNS", "80")  # the width a script without a terminal gets
    for script in ("tspo.py", *(f"{m}.py" for m in PIPELINES if m != "tspo"), "eval.py"):
        path = ROOT / "pipelines" / script
        if script == "tspo.py":
            out = subprocess.run(
                [sys.executable, str(path), "--help"],
                capture_output=True, text=True, cwd=ROOT, timeout=120,
            )  # fmt: skip
            code, stdout = out.returncode, out.stdout
        else:
            with pytest.raises(SystemExit) as exit_, _argv0(path):
                if script == "eval.py":
                    run_config_class(path, "main")(["--help"])
                else:
                    method = script.removesuffix(".py")
                    main(load(script, PIPELINES[method]), method, "", argv=["--help"])
            code, stdout = exit_.value.code, capsys.readouterr().out
        assert code == 0 and "--data.questions" in stdout, script
        assert "--generator.backend" in stdout and "--generator.vllm.kv_cache_gb" in stdout
        # one group per section, titled and described by its config class; choices shown
        assert "\ngenerator:\n  How rollouts are generated" in stdout, script
        assert "\ngenerator.vllm:\n  vLLM engine settings of a generator" in stdout
        assert "--generator.backend {transformers,vllm}" in stdout
        # docstrings without their reST markup
        markup = re.findall(r"``|:(?:func|data|class|meth|mod|attr|math):`", stdout)
        assert markup == [], (script, markup)
        if script != "eval.py":
            assert "--learner.off_policy {none,tis,decoupled}" in stdout
            assert "--learner.betas A,B " in stdout
            assert "\nlearner.loss:\n  Settings of the clipped policy-gradient loss." in stdout
    from ray_credit.pipeline.configs import load_config

    tspo = load("tspo.py", "TSPORun")
    with pytest.raises(SystemExit) as exit_:
        load_config(tspo, "tspo", ["--pipeline.steps", "zero"])
    assert exit_.value.code == 2 and "--pipeline.steps" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        load_config(tspo, "tspo", ["--learner.off_policy", "ppo"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.endswith(
        "--learner.off_policy: learner.off_policy must be one of ['none', 'tis', 'decoupled'], "
        "got 'ppo'\n"
    ), err


def _no_ray(*args, **kwargs):
    raise AssertionError("the run went on to start Ray: the input was not refused before")


def test_bad_input_before_ray_is_one_line_naming_it(tmp_path, monkeypatch):
    """A resume folder that is not a checkpoint, an impossible split: refused before Ray
    starts, in one line that says what to do, as argparse's errors are."""
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "pipeline.json").write_text("{}")
    for folder in ("run/checkpoint", "cut/step_000002.tmp", "damaged/learner"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "run" / "checkpoint" / "pipeline.json").write_text("{}")
    (tmp_path / "cut" / "step_000002.tmp" / "pipeline.json").write_text("{}")
    (tmp_path / "damaged" / "pipeline.json").write_text('{"step": ')
    cases = [
        (["--resume", str(tmp_path / "nope")], "--resume .*nope: no such folder; pass the "
         "checkpoint folder"),
        (["--resume", str(tmp_path / "half")], "--resume .*half: not a pipeline checkpoint \\(it has no learner\\)"),
        (["--data.eval_questions", "-1"], "data.eval_questions=-1 must hold out at least one"),
        (["--resume", str(tmp_path / "run")], "--resume .*run: that is a run's folder; its "
         "checkpoint is .*run/checkpoint"),
        (["--resume", str(tmp_path / "cut")], "--resume .*cut: .*cut holds no checkpoint \\(only "
         "step_000002.tmp: a save cut off"),
        (["--resume", str(tmp_path / "damaged")], "--resume .*damaged: pipeline.json is damaged"),
        (["--data.questions", str(tmp_path / "q.jsonl"), "--data.corpus", str(tmp_path / "no.jsonl")],
         "data.corpus '.*no.jsonl' does not exist"),
        # what used to fail in an actor, minutes later, after the warm-start
        (["--model", str(tmp_path / "no" / "such")], "model='.*no/such': no such folder; give an "
         "embedded name"),
        (["--model", str(tmp_path / "half")], "model='.*half': .*half' is a folder but not a model "
         "folder: it has no config.json"),
        (["--generator.prompt_template", "nosuch.txt"], "generator.prompt_template: prompt template "
         "file 'nosuch.txt' does not exist"),
        (["--pipeline.stratify_by", "hop"], "pipeline.stratify_by='hop', but 282 of 282 training "
         "questions have no 'hop'"),
        (["--warm_start.questions", "100000"], "warm_start.questions=100000 is more than the 282 "
         "training questions"),
        # the retriever's inputs: its encoder, its corpus's first document, a server's URL
        (["--retriever.encoder.name", str(tmp_path / "no" / "encoder")], "retriever.encoder.name="
         "'.*no/encoder': no such folder; give one of \\['bge-base-en-v1.5', .*'minilm'\\], a "
         "Hugging Face model folder"),
        (["--retriever.url", "http://127.0.0.1:9/retrieve"], "retriever.url: "),
        (["--data.questions", str(tmp_path / "q.jsonl"), "--data.corpus", str(tmp_path / "c.jsonl"),
          "--data.eval_questions", "1", "--warm_start.enabled", "false",
          "--pipeline.stratify_by", "none"], "data.corpus: .*c.jsonl:1"),
        # index settings that cannot work for the corpus, and an index file not there
        (["--retriever.index.kind", "ivfpq"], "retriever.index: index kind 'ivfpq' with "
         "nlist=1024, pq_nbits=8 trains on the corpus and needs at least 1024 passages; the "
         "corpus has 72"),
        (["--retriever.index.kind", "ivfpq", "--retriever.index.nlist", "8",
          "--retriever.index.nprobe", "8", "--retriever.index.pq_nbits", "4",
          "--retriever.index.pq_m", "10"], "retriever.index: index pq_m=10 must divide the "
         "embedding dimension 384"),
        (["--retriever.index_file", str(tmp_path / "e5_Flat.index")], "retriever.index_file "
         "'.*e5_Flat.index' does not exist"),
        # a cluster launcher YAML: a file named is there, reads and is used
        (["--resources.cluster_config", str(tmp_path / "missing.yaml")], "resources."
         "cluster_config '.*missing.yaml': no such file; give the cluster launcher YAML"),
        (["--resources.cluster_config", str(tmp_path / "many.yaml")], "resources.cluster_config "
         ".*many.yaml: available_node_types.generator_gpu.resources.CPU: expected a number, got "
         "'many'"),
        (["--resources.cluster_config", str(ROOT / "cluster.yaml")], "resources.cluster_config "
         ".*cluster.yaml: this run is not on a cluster \\(RAY_ADDRESS is not set\\), so it "
         "would start a local Ray"),
    ]  # fmt: skip
    many = (ROOT / "cluster.local.yaml").read_text()
    many = many.replace("{CPU: 2, GPU: 1, generator: 1}", "{CPU: many, GPU: 1, generator: 1}")
    assert "CPU: many" in many
    (tmp_path / "many.yaml").write_text(many)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # a run that starts a local Ray
    cluster = [  # one that joins a cluster has no local Ray to size
        (["--resources.local_gpus", "8"], "resources.local_gpus=8 sizes the local Ray a run "
         "starts on this machine, and this run joins the cluster at RAY_ADDRESS"),
    ]  # fmt: skip
    questions = [{"id": str(i), "question": f"who is {i}?", "golden_answers": [f"p{i}"]}
                 for i in range(3)]  # fmt: skip
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    (tmp_path / "c.jsonl").write_text("not a document\n")
    from ray_credit.pipeline import recipe
    from ray_credit.pipeline.cli import main

    monkeypatch.setattr(recipe, "connect", _no_ray)  # refused before Ray starts
    if "ray" in sys.modules:  # the suite's shared cluster: a script's own process has none
        monkeypatch.setattr(sys.modules["ray"], "is_initialized", lambda: False)
    script = ROOT / "pipelines" / "tspo.py"
    for i, (flags, message) in enumerate(cases + cluster):
        if i == len(cases):
            monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:9")  # never reached: refused
        flags = [*flags, "--output_dir", str(tmp_path / "runs"), "--wandb", "disabled"]
        if i == 0:  # the script itself: exit status 1, one line on stderr, no traceback
            out = subprocess.run(
                [sys.executable, str(script), *flags],
                capture_output=True, text=True, cwd=ROOT, timeout=120,
            )  # fmt: skip
            assert out.returncode == 1, (flags, out.stderr[-2000:])
            error = out.stderr
            assert "Traceback" not in error and "Started a local Ray" not in error
        else:  # the same main() in this process: a second each instead of a new Python
            with pytest.raises(SystemExit) as exit_, _argv0(script):
                main(load("tspo.py", "TSPORun"), "tspo", "", argv=flags)
            error = f"{exit_.value.code}\n"
        assert re.fullmatch(f"tspo.py: error: {message}.*\n", error), (flags, error[-2000:])


def test_an_encoder_is_refused_with_the_names_an_encoder_takes(monkeypatch):
    """An encoder given a policy's embedded name is not taken for a policy: it is looked up
    as a model id, and the refusal lists the encoders' names, not the policies'."""
    import transformers

    from ray_credit.actors.encoder import ENCODER_PRESETS
    from ray_credit.config import InputError
    from ray_credit.pipeline.preflight import check_model

    def offline(*args, **kwargs):
        raise OSError("no connection")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", offline)
    with pytest.raises(InputError) as err:
        check_model("retriever.encoder.name", "smollm2-135m", names=list(ENCODER_PRESETS))
    assert re.fullmatch(
        r"retriever.encoder.name='smollm2-135m' is not a folder here, .*\(no connection\); "
        r"give one of \['bge-base-en-v1.5', .*'minilm'\], a Hugging Face model folder .*",
        str(err.value),
    ), str(err.value)
    check_model("model", "smollm2-135m")  # a policy's embedded name, where a policy is asked


@contextlib.contextmanager
def _argv0(script: Path):
    """sys.argv[0] as when ``script`` runs (the program name in errors; its folder holds
    the other pipelines)."""
    saved = sys.argv[0]
    sys.argv[0] = str(script)
    try:
        yield
    finally:
        sys.argv[0] = saved


@dataclass(frozen=True)
class TSPORun(RunConfig):
    tspo: TSPOConfig = field(default_factory=TSPOConfig)


def load(script: str, cls_name: str):
    """A pipeline script's run config class."""
    return run_config_class(ROOT / "pipelines" / script, cls_name)


EMBEDDED = EMBEDDED_CONFIG


def test_a2tgpo_trains_with_its_papers_turn_level_loss(capsys):
    """The estimator's declaration is the pipeline's default: A2TGPO's turn-level ratio,
    clip range and log-prob information gain; a flag that changes it is a departure the
    plan reports."""
    from ray_credit.pipeline.configs import load_config
    from ray_credit.pipeline.plan import make_plan

    run = load("a2tgpo.py", "A2TGPORun")
    cfg = load_config(run, "a2tgpo", [], default_config=EMBEDDED)
    loss = cfg.learner.loss
    assert (loss.ratio_level, loss.clip_low, loss.clip_high) == ("turn", 3e-3, 4e-3)
    assert cfg.info_gain.mode == "log_prob_diff" and cfg.learner.kl_coef == 0.0
    questions = [{"question": "q?", "golden_answers": ["a"]}]
    plan = make_plan(cfg, "a2tgpo", questions)
    assert plan.departures == () and [s.name for s in plan.signals] == ["info_gain"]
    changed = load_config(
        run, "a2tgpo", ["--learner.loss.ratio_level", "token"], default_config=EMBEDDED
    )
    assert make_plan(changed, "a2tgpo", questions).departures == (
        "learner.loss.ratio_level = 'token' (recipe: 'turn')",
    )
    igpo = load_config(load("igpo.py", "IGPORun"), "igpo", [], default_config=EMBEDDED)
    assert igpo.learner.loss.ratio_level == "token" and igpo.info_gain.mode == "prob_diff"
    assert igpo.learner.kl_coef == 1e-3


def test_generator_backend_settings_and_refusals(capsys):
    """The embedded run generates with vLLM; engine settings are flags; combinations that
    cannot work are refused before any actor starts, saying what to change."""
    from ray_credit.pipeline.configs import load_config

    run = load("tspo.py", "TSPORun")
    cfg = load_config(run, "tspo", [], default_config=EMBEDDED)
    assert cfg.generator.backend == "vllm" and cfg.generator.dtype == "native"
    cfg = load_config(
        run, "tspo",
        ["--generator.vllm.kv_cache_gb", "3", "--generator.vllm.max_model_len", "4096",
         "--generator.vllm.enable_prefix_caching", "false", "--generator.dtype", "bfloat16"],
        default_config=EMBEDDED,
    )  # fmt: skip
    vllm = cfg.generator.vllm
    assert (vllm.kv_cache_gb, vllm.max_model_len, vllm.enable_prefix_caching) == (3, 4096, False)
    assert cfg.generator.dtype == "bfloat16"
    refusals = {
        "weight_sync='nccl'.*object store": ["--pipeline.weight_sync", "nccl"],
        "tensor_parallel_size=2.*generator_gpus=0": ["--generator.vllm.tensor_parallel_size", "2"],
        "max_model_len \\(1024\\) is below max_context_tokens": [
            "--generator.vllm.max_model_len",
            "1024",
        ],
        "backend must be one of": ["--generator.backend", "sglang"],
        "dtype must be one of": ["--generator.dtype", "float64"],
        "kv_cache_gb must be >= 1": ["--generator.vllm.kv_cache_gb", "0"],
    }
    for message, argv in refusals.items():
        with pytest.raises(SystemExit):  # the parser's error: usage, then the reason
            load_config(run, "tspo", argv, default_config=EMBEDDED)
        assert re.search(message, capsys.readouterr().err), message


def test_plans_refuse_what_cannot_work():
    from ray_credit.pipeline.configs import load_config
    from ray_credit.pipeline.plan import make_plan

    cw = load_config(load("cw_grpo.py", "CWGRPORun"), "cw_grpo", [], default_config=EMBEDDED)
    no_support = [{"question": "q?", "golden_answers": ["a"], "supporting_doc_ids": None}]
    with pytest.raises(
        ValueError, match="no training question has supporting_doc_ids.*--judge.backend hf"
    ):
        make_plan(cw, "cw_grpo", no_support)
    sp1 = load_config(
        load("search_p1.py", "SearchP1Run"), "search_p1",
        ["--judge.backend", "hf", "--judge.model", "tiny-random"], default_config=EMBEDDED,
    )  # fmt: skip
    plan = make_plan(sp1, "search_p1", no_support)  # an LLM judge: plans are made first
    assert [s.name for s in plan.question_signals] == ["reference_plan"]
    with_plans = [{**no_support[0], "reference_plan": ["find q"]}]
    assert make_plan(sp1, "search_p1", with_plans).question_signals == ()
    igpo = load_config(
        load("igpo.py", "IGPORun"),
        "igpo",
        ["--pipeline.weight_sync", "gloo", "--generator.backend", "transformers"],
        default_config=EMBEDDED,
    )
    with pytest.raises(ValueError, match="weight_sync='gloo'.*object_store"):
        make_plan(igpo, "igpo", no_support)


def test_resource_demand_is_the_busiest_phase_and_a_shortage_is_named():
    from ray_credit.pipeline.configs import ResourcesConfig
    from ray_credit.pipeline.plan import make_plan
    from ray_credit.pipeline.services import _shortage, resource_demand
    from tests.unit.test_pipeline_scripts import TSPORun

    res = ResourcesConfig(
        num_generators=2,
        generator_gpus=1.0,
        learner_workers=2,
        use_gpu=True,
        generator_resource="generator",
        learner_resource="learner",
        service_resource="service",
    )
    assert res.custom("generator") == {"generator": 1.0}
    assert ResourcesConfig().custom("learner") == {}
    cfg = TSPORun(resources=res)
    plan = make_plan(cfg, "tspo", [{"question": "q?", "golden_answers": ["a"]}])
    # Training holds 2 generators (1 CPU, 1 GPU each), 2 learner replicas (2 CPUs, 1 GPU
    # each) and the retriever (0.25 CPU); the evaluation generator (2 CPUs, 1 GPU) runs
    # before and after it, never beside the training generators.
    demand = resource_demand(cfg, plan)
    assert demand == {"CPU": 6.25, "GPU": 4.0, "generator": 2.0, "learner": 2.0, "service": 1.0}
    assert _shortage(demand, {**demand, "CPU": 12.0}) == ""
    short = _shortage(demand, {**demand, "GPU": 3.0, "service": 0.0})
    assert short == "4 GPU (cluster has 3), 1 service (cluster has 0)"


def test_every_pipeline_fits_the_local_ray_it_starts_on_its_defaults():
    """A pipeline started with no cluster starts a local Ray of at least 6 logical CPUs
    (more when its actors ask for more); on the embedded settings none asks for more than
    6 (A2TGPO's scorer and evaluation generator used to ask for 6.25 together)."""
    from ray_credit.pipeline.configs import load_config
    from ray_credit.pipeline.plan import make_plan
    from ray_credit.pipeline.services import resource_demand

    for method, cls in PIPELINES.items():
        cfg = load_config(run_config_class(ROOT / "pipelines" / f"{method}.py", cls), method, [])
        questions = [{"question": "q?", "golden_answers": ["a"], "supporting_doc_ids": ["d"]}]
        demand = resource_demand(cfg, make_plan(cfg, method, questions))
        assert demand["CPU"] <= 6, (method, demand)


def test_an_estimator_across_groups_runs_once_per_step():
    import dataclasses

    from ray_credit.estimators import get_estimator
    from ray_credit.pipeline.plan import make_plan

    across = dataclasses.replace(get_estimator("tspo"), group_local=False)
    plan = make_plan(TSPORun(), across, [{"question": "q?", "golden_answers": ["a"]}])
    stages, step_stages = plan.stages(timeout_s=1.0)
    assert stages == [] and [s.__name__ for s in step_stages] == ["estimator_tspo"]
    local = make_plan(TSPORun(), "tspo", [{"question": "q?", "golden_answers": ["a"]}])
    assert [s.__name__ for s in local.stages(timeout_s=1.0)[0]] == ["estimator_tspo"]
    with pytest.raises(ValueError, match="needs a section 'grpo: GRPOConfig'"):
        make_plan(TSPORun(), "grpo", [{"question": "q?", "golden_answers": ["a"]}])


def test_eval_before_reads_per_question_outcomes_or_says_what_it_needs(tmp_path):
    sys.path.insert(0, str(ROOT / "pipelines"))
    from eval import read_before

    outcomes = {"em": 0.5, "correct": {"0:q": 1, "1:r": 0}, "source": {"0:q": "a", "1:r": "b"}}
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"eval_before": outcomes, "steps": 3}))
    assert read_before(str(summary)) == outcomes
    own = tmp_path / "eval.json"
    own.write_text(json.dumps(outcomes))
    assert read_before(str(own)) == outcomes
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"em": 0.5}))  # an eval.py file from before it kept outcomes
    with pytest.raises(SystemExit, match="no per-question outcomes"):
        read_before(str(bare))
    with pytest.raises(SystemExit, match="cannot read it as JSON"):
        read_before(str(tmp_path / "missing.json"))


def test_eval_refuses_bad_input_before_ray(tmp_path, capsys, monkeypatch):
    """pipelines/eval.py: a missing output folder, a model that is not there, a --before
    file without outcomes: one line, before Ray starts (an evaluation takes minutes). A
    question file of 3 questions is evaluated whole with --split all (refused only for its
    model here), as it is with no --split, and refused with the held-out split, which
    takes 120 of them."""
    (tmp_path / "empty.json").write_text('{"correct": {}, "source": {}, "em": 0}')
    questions = [{"question": f"who is {i}?", "golden_answers": [f"p{i}"]} for i in range(3)]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    (tmp_path / "c.jsonl").write_text('{"id": "d0", "contents": "P0\\np0 is 0."}\n')
    data = [
        "--data.questions",
        str(tmp_path / "q.jsonl"),
        "--data.corpus",
        str(tmp_path / "c.jsonl"),
    ]
    cases = [
        (["--output", str(tmp_path / "no" / "r.json")], "--output .*r.json: its folder does not exist"),
        (["--model", str(tmp_path / "none")], "--model='.*none': no such folder"),
        (["--before", str(tmp_path / "empty.json")], "--before .*empty.json: holds no per-question"),
        # a setting out of range is argparse's error (exit status 2), naming the flag
        (["--samples", "-1"], "--samples: samples must be >= 0 \\(0: greedy only\\), got -1"),
        ([*data, "--split", "all", "--model", str(tmp_path / "none")], "--model='.*none': no such"),
        # no --split: a question file no training run split is evaluated whole
        ([*data, "--model", str(tmp_path / "none")], "--model='.*none': no such"),
        ([*data, "--split", "heldout", "--model", str(tmp_path / "none")],
         "data.eval_questions=120 must hold out"),
        # an eval file is what is evaluated: a --split that would leave it out is refused
        ([*data, "--data.eval_file", str(tmp_path / "q.jsonl"), "--split", "all"],
         "--split all evaluates every question of data.questions, and data.eval_file=.* would go "
         "unevaluated; drop --split"),
        # the held-out split of a checkpoint's own questions is the one its run held out
        ([*data, "--model", str(tmp_path / "run")], "--model .*run: its run held out questions "
         "with pipeline.seed=3; eval.py's --seed 0 holds out others, some of them trained on: "
         "pass --seed 3"),
        ([*data, "--model", str(tmp_path / "run"), "--seed", "3"], "its run held out "
         "data.eval_questions=1; 120 here picks others.*pass --data.eval_questions 1"),
        (["--model", str(tmp_path / "synthetic")], "its run trained on another synthetic world "
         "\\(it differs in num_entities\\).*pass --data.world.num_entities 20"),
        (["--resources.cluster_config", str(tmp_path / "missing.yaml")],
         "resources.cluster_config '.*missing.yaml': no such file"),
        # the retriever's inputs, as a training run's: they failed in its actor, after Ray
        (["--retriever.encoder.name", str(tmp_path / "no" / "encoder")],
         "retriever.encoder.name='.*no/encoder': no such folder"),
        (["--retriever.index.kind", "ivfpq"], "retriever.index: index kind 'ivfpq' with "
         "nlist=1024, pq_nbits=8 trains on the corpus and needs at least 1024 passages"),
        # a question file with the embedded CPU demo's retrieval and limits
        ([*data, "--model", "tiny-random"], "data.questions .*q.jsonl is evaluated with the "
         "embedded CPU demo's settings \\(retriever.encoder.name 'minilm', "
         "generator.max_new_tokens 32, generator.topk 1, .*\\), made for the synthetic world; "
         "give the settings of the run that trained the policy: --config "
         "pipelines/configs/search_r1.yaml"),
    ]  # fmt: skip
    run = {"data": {"questions": str(tmp_path / "q.jsonl"), "eval_questions": 1,
                    "eval_file": None}, "pipeline": {"seed": 3}}  # fmt: skip
    _checkpoint(tmp_path / "run", run)
    _checkpoint(tmp_path / "synthetic", {"data": {"questions": "synthetic", "eval_questions": 120,
                                                  "world": {"num_entities": 20}}})  # fmt: skip
    script = ROOT / "pipelines" / "eval.py"
    eval_main = run_config_class(script, "main")
    monkeypatch.setitem(eval_main.__globals__, "connect", _no_ray)  # refused before Ray
    for i, (flags, message) in enumerate(cases):
        status = 2 if flags[0] == "--samples" else 1
        if i == 0:  # the script itself; the others through its main, in this process
            out = subprocess.run(
                [sys.executable, str(script), *flags],
                capture_output=True, text=True, cwd=ROOT, timeout=120,
            )  # fmt: skip
            code, error = out.returncode, out.stderr
            assert "Traceback" not in error and "Started a local Ray" not in error
        else:
            with pytest.raises(SystemExit) as exit_, _argv0(script):
                eval_main(flags)
            code = exit_.value.code if isinstance(exit_.value.code, int) else 1
            error = capsys.readouterr().err + ("" if code == 2 else str(exit_.value.code))
        assert code == status, (flags, error[-2000:])
        assert re.search(message, error), (flags, error[-2000:])


def _checkpoint(folder: Path, run_config: dict) -> None:
    """A training run's checkpoint folder as eval.py reads it: a step's state with the
    run's config, and a policy folder."""
    step = folder / "step_000002"
    (step / "learner" / "model").mkdir(parents=True)
    (step / "learner" / "model" / "config.json").write_text("{}")
    state = {"step": 2, "metadata": {"run_config": run_config}}
    (step / "pipeline.json").write_text(json.dumps(state))


def test_eval_evaluates_the_eval_file_it_is_given_and_says_which(tmp_path, capsys, monkeypatch):
    """pipelines/eval.py with --data.eval_file evaluates every question of that file, as a
    training run given one evaluates it (it used to evaluate the training questions, or
    all of data.questions, without a word); the line before Ray names the file and the
    count. A checkpoint's held-out split with its run's seed is evaluated as such."""
    questions = [{"question": f"who is {i}?", "golden_answers": [f"p{i}"]} for i in range(5)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions[:3]))
    (tmp_path / "c.jsonl").write_text('{"id": "d0", "contents": "P0\\np0 is 0."}\n')
    train = str(tmp_path / "train.jsonl")
    _checkpoint(tmp_path / "run", {"data": {"questions": train, "eval_questions": 2,
                                            "eval_file": None}, "pipeline": {"seed": 3}})  # fmt: skip
    (tmp_path / "settings.yaml").write_text("generator: {max_new_tokens: 64, topk: 3}\n")
    data = ["--data.questions", train, "--data.corpus", str(tmp_path / "c.jsonl"),
            "--config", str(tmp_path / "settings.yaml")]  # fmt: skip
    script = ROOT / "pipelines" / "eval.py"
    eval_main = run_config_class(script, "main")
    monkeypatch.setitem(eval_main.__globals__, "connect", _no_ray)
    for flags, line in (
        ([*data, "--data.eval_file", str(tmp_path / "test.jsonl")],
         "evaluating 3 questions: split eval_file, every question of data.eval_file "
         f"{tmp_path / 'test.jsonl'}"),
        ([*data, "--seed", "3", "--data.eval_questions", "2"],
         f"evaluating 2 questions: split heldout, those held out of data.questions {train} by "
         f"--seed 3 (data.eval_questions 2; the checkpoint's run trained on {train})"),
    ):  # fmt: skip
        with pytest.raises(AssertionError, match="went on to start Ray"), _argv0(script):
            eval_main([*flags, "--model", str(tmp_path / "run")])
        assert line in capsys.readouterr().out.splitlines(), flags


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pipline.steps", "3"], "--pipline.steps: no such setting; did you mean --pipeline.steps?"),
        (["--learner.learning_rate", "1e-5"],
         "--learner.learning_rate: learner has no setting 'learning_rate'; did you mean --learner.lr?"),
        (["--igpo.gamma", "0.9"], "--igpo.gamma: --igpo.* are the igpo estimator's settings, for "
         "a run that trains igpo (pipelines/igpo.py); this run trains tspo (its settings: --tspo.*)"),
        (["--info_gain.mode", "prob_diff"], "--info_gain.* are the info_gain signal's settings, "
         "for a run that trains a2tgpo or igpo"),
        (["--tspo.beta", "1"], "--tspo.beta: tspo has no setting 'beta'; its settings: --tspo.alpha, "
         "--tspo.strategy"),
        (["--generator.group_size", "1"], "generator.group_size=1: every estimator compares the G "
         "samples of a question"),
    ],
)  # fmt: skip
def test_a_setting_the_pipeline_lacks_is_named_with_what_was_meant(
    argv, message, capsys, monkeypatch
):
    from ray_credit.pipeline.configs import load_config

    monkeypatch.setattr(sys, "argv", [str(ROOT / "pipelines" / "tspo.py")])  # the script's folder
    with pytest.raises(SystemExit) as exit_:
        load_config(load("tspo.py", "TSPORun"), "tspo", argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_user_stages_go_around_the_estimator_and_are_departures():
    from ray_credit.pipeline.plan import make_plan

    questions = [{"question": "q?", "golden_answers": ["a"]}]

    def shaped(batch):
        return batch

    def reweighted(batch):
        return batch

    plan = make_plan(TSPORun(), "tspo", questions, stages=[shaped], stages_after=[reweighted])
    chunk, step = plan.stages(timeout_s=1.0)
    assert [s.__name__ for s in chunk] == ["shaped", "estimator_tspo", "reweighted"]
    assert step == []
    assert plan.departures == (
        "stage 'shaped' of your own, before the estimator",
        "stage 'reweighted' of your own, after the estimator",
    )
    # a stage that is not group-local runs once per step, and so does all after it
    reweighted.group_local = False
    chunk, step = plan.stages(timeout_s=1.0)
    assert [s.__name__ for s in chunk] == ["shaped", "estimator_tspo"]
    assert [s.__name__ for s in step] == ["reweighted"]
    shaped.group_local = False
    chunk, step = plan.stages(timeout_s=1.0)
    assert chunk == [] and [s.__name__ for s in step] == [
        "shaped", "estimator_tspo", "reweighted"
    ]  # fmt: skip
    with pytest.raises(ValueError, match="stages takes functions batch -> batch, got 3"):
        make_plan(TSPORun(), "tspo", questions, stages=[3])


def test_a_composition_brings_its_parts_recipe_and_is_read_like_any_setting(tmp_path, capsys):
    """pipelines/compose.py: the --estimator flag, else --config's file, else the default;
    its parts' signals become the plan's stages and their learner settings the defaults;
    a paper's name runs its composition with its recipe; a composition that cannot work
    is one line naming the reason, before Ray."""
    from ray_credit.pipeline.cli import composed_estimator, main
    from ray_credit.pipeline.configs import load_config
    from ray_credit.pipeline.plan import make_plan

    run = load("compose.py", "ComposeRun")
    questions = [{"question": "q?", "golden_answers": ["a"], "supporting_doc_ids": ["d"]}]
    text = "0.3*(info_gain | turn_position(padding='none')) + (outcome | group) | adaptive_clip"
    argv = ["--estimator", text]
    est = composed_estimator(run, argv)
    cfg = load_config(run, est, argv, default_config=EMBEDDED)
    assert cfg.estimator == est.name == text and cfg.learner.loss.ratio_level == "turn"
    plan = make_plan(cfg, est, questions)
    assert [s.name for s in plan.signals] == ["info_gain"] and plan.departures == ()
    judged = composed_estimator(run, ["--estimator", "folr | turn_position | contribution"])
    plan = make_plan(load_config(run, judged, [], default_config=EMBEDDED), judged, questions)
    assert [s.name for s in plan.signals] == ["cw_grpo_judgement"]

    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text('estimator: "outcome | leave_one_out"\n')
    assert composed_estimator(run, ["--config", str(yaml_file)]).name == "outcome | leave_one_out"
    assert composed_estimator(run, []).name == run().estimator  # the script's default
    igpo = composed_estimator(run, ["--estimator", "igpo"])  # a paper's name: its parts
    assert igpo.name == "info_gain + outcome(at='last') | group_turns | discount"
    assert igpo.learner == {"kl_coef": 1e-3} and igpo.signals == {
        "info_gain": {"mode": "prob_diff"}
    }

    for bad, says in (("folr | group", "one value per trajectory"),
                      ("outcome | contribution", "normalize the rewards first")):  # fmt: skip
        with pytest.raises(SystemExit) as err:
            main(run, None, "doc", argv=["--estimator", bad])
        assert "error: --estimator" in str(err.value) and says in str(err.value)


def test_eval_takes_the_settings_of_the_checkpoint_s_run_and_says_so(tmp_path, capsys, monkeypatch):
    """Without --config, a training checkpoint is evaluated with its run's encoder, index
    and rollout limits (search_r1.yaml's here), not the embedded demo's, and the line
    before Ray says whose settings they are; a question file given replaces the run's
    evaluation file."""
    from dataclasses import asdict

    from ray_credit.pipeline.configs import load_config

    sys_argv, sys.argv = sys.argv, [str(ROOT / "pipelines" / "tspo.py")]
    try:
        trained = load_config(load("tspo.py", "TSPORun"), "tspo",
                              ["--config", str(ROOT / "pipelines/configs/search_r1.yaml"),
                               "--retriever.encoder.name", "minilm"])  # fmt: skip
    finally:
        sys.argv = sys_argv
    _checkpoint(tmp_path / "run", asdict(trained))
    questions = [{"question": f"who is {i}?", "golden_answers": [f"p{i}"]} for i in range(3)]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    (tmp_path / "c.jsonl").write_text('{"id": "d0", "contents": "P0\\np0 is 0."}\n')
    seen = {}

    def connect(cfg, *args, **kwargs):
        seen["cfg"] = cfg
        raise AssertionError("went on to start Ray")

    script = ROOT / "pipelines" / "eval.py"
    eval_main = run_config_class(script, "main")
    monkeypatch.setitem(eval_main.__globals__, "connect", connect)
    monkeypatch.setitem(eval_main.__globals__, "check_model", lambda *a, **k: None)
    with pytest.raises(AssertionError, match="went on to start Ray"), _argv0(script):
        eval_main(["--model", str(tmp_path / "run"), "--data.questions",
                   str(tmp_path / "test.jsonl"), "--data.corpus", str(tmp_path / "c.jsonl")])  # fmt: skip
    out = capsys.readouterr().out
    assert f"settings: the run's that made the checkpoint {tmp_path / 'run'}; flags" in out
    assert "evaluating 3 questions: split all, every question of data.questions" in out
    cfg = seen["cfg"]
    assert (cfg.generator.max_new_tokens, cfg.generator.topk, cfg.generator.max_turns) == (
        500,
        3,
        5,
    )
    assert cfg.resources.num_generators == 4 and cfg.data.eval_file is None
