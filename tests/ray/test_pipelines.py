"""The pipeline scripts as users run them (subprocess, connected to the shared cluster
through RAY_ADDRESS), with tiny-random: outputs, then a resumed run. Whole runs are the
second test command's (`pytest -m e2e`); the default one keeps an in-process train()."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ray_credit.pipeline import checkpoints, resolve_checkpoint

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "--model", "tiny-random",
    "--pipeline.steps", "2",
    "--pipeline.groups_per_step", "2",
    "--data.eval_questions", "4",
    "--data.world.num_entities", "20",
    "--resources.generator_cpus", "0.5",
    "--resources.learner_cpus", "0.5",
    "--resources.eval_cpus", "0.5",
    # the embedded default is vLLM; these tests are about the pipelines, and tiny-random
    # on the transformers sampler starts in a second (tests/e2e/test_cluster.py's
    # job submission runs the default backend)
    "--generator.backend", "transformers",
    # the warm-start has a test of its own (test_tspo_writes_its_outputs_and_resumes)
    "--warm_start.enabled", "false",
]  # fmt: skip


def run(script, args, ray_cluster, timeout=600, cwd=ROOT):
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    out = subprocess.run(
        [sys.executable, str(ROOT / "pipelines" / script), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


@pytest.mark.e2e  # three runs of the scripts (warm-start, resume, eval.py): the second test command
@pytest.mark.slow
def test_tspo_writes_its_outputs_and_resumes(ray_cluster, tmp_path):
    """Outputs in output_dir/name; checkpoints, the warm start and a copy of the outputs in
    storage_path/name (a file:// URI here, as s3:// would be), from which a resume on a
    machine without the outputs continues the run, its history included."""
    bucket = f"file://{tmp_path}/bucket"
    args = [
        *SMALL, "--output_dir", str(tmp_path), "--storage_path", bucket, "--eval.samples", "2",
        "--warm_start.enabled", "true", "--warm_start.questions", "8", "--warm_start.epochs", "1",
    ]  # fmt: skip
    stdout = run("tspo.py", args, ray_cluster)
    out, stored = tmp_path / "tspo", tmp_path / "bucket" / "tspo"
    assert "eval before training: EM" in stdout and "step 2/2" in stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["groups_trained"] == 4
    assert 0 <= summary["eval_before"]["em"] <= 1 and "em_by_source" in summary["eval_after"]
    # the embedded warm-start ran first, and its policy is what the generators loaded
    assert (
        "warm-start: saved in" in stdout and summary["warm_start"]["warm_start/demonstrations"] > 0
    )
    assert summary["policy"] == str(stored / "warm_start")  # on storage every node sees
    assert "held-out EM, paired on the same questions" in stdout
    assert summary["eval_change"]["all"]["n"] == 4  # the same 4 questions, before and after
    # eval.samples: 2 sampled rollouts per question too, paired the same way
    assert summary["eval_before"]["sampled"]["samples"] == 2
    assert set(summary["eval_after"]["sampled"]["correct"]) == set(summary["eval_after"]["correct"])
    assert "held-out sampled EM (2 samples per question)" in stdout
    assert summary["eval_change_sampled"]["all"]["n"] == 4
    assert (out / "plot.png").stat().st_size > 1000
    assert summary["checkpoint"] == f"{bucket}/tspo/checkpoint"
    # the embedded run checkpoints every step and keeps the newest two
    assert [step for step, _ in checkpoints(summary["checkpoint"])] == [1, 2]
    assert not (out / "checkpoint").exists()
    for name in ("summary.json", "metrics.jsonl", "plot.png"):  # the copy in storage
        assert (stored / name).read_bytes() == (out / name).read_bytes()
    assert any((out / "wandb").iterdir())  # the offline wandb run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["pipeline/step"] for r in rows] == [1, 2]
    for key in ("train/reward_mean", "learner/grad_norm", "staleness/max", "gen/tokens_per_s"):
        assert key in rows[-1]

    first = summary
    for name in ("summary.json", "metrics.jsonl", "plot.png"):  # a new head node
        (out / name).unlink()
    # --resume takes the run's own settings from its checkpoint: only what changes is given
    stdout = run("tspo.py", ["--resume", summary["checkpoint"], "--pipeline.steps", "3"],
                 ray_cluster, cwd=tmp_path)  # fmt: skip
    assert "warm-start: reused" in stdout  # the resumed learner's weights sit on the same base
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["groups_trained"] == 6  # none lost, none twice
    assert summary["config"]["model"] == "tiny-random"  # the first run's settings...
    assert summary["config"]["data"] == first["config"]["data"]
    assert summary["config"]["pipeline"]["steps"] == 3  # ...and the flag given with --resume
    # the history is kept: the first run's evaluation before training (not the resumed
    # policy's), paired with the evaluation after step 3; one wandb run; every step once
    assert "kept from" in stdout and summary["eval_before"] == first["eval_before"]
    assert summary["eval_change"]["all"]["n"] == 4
    assert summary["eval_change_sampled"]["all"]["n"] == 4  # eval.samples came with the config
    assert summary["wandb_id"] == first["wandb_id"] is not None
    assert [s["step"] for s in summary["starts"]] == [0, 2]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["pipeline/step"] for r in rows] == [1, 2, 3]

    # eval.py on the checkpoint: the same held-out questions, per data source
    result_file = tmp_path / "eval.json"
    stdout = run(
        "eval.py",
        [
            "--model", str(stored / "checkpoint"),
            "--data.eval_questions", "4",
            "--data.world.num_entities", "20",
            "--resources.generator_cpus", "0.5",
            "--output", str(result_file),
            "--before", str(out / "summary.json"),
            "--samples", "2",
        ],
        ray_cluster,
    )  # fmt: skip
    result = json.loads(result_file.read_text())
    assert result["model"].endswith("checkpoint/step_000003/learner/model")  # the newest
    assert result["questions"] == 4
    # paired with the run's own evaluation of the same 4 questions
    assert result["change"]["all"]["n"] == 4 and "held-out EM, paired" in stdout
    assert set(result["correct"]) == set(summary["eval_before"]["correct"])
    assert result["source"] == summary["eval_before"]["source"]  # each question's source
    assert set(result["searches_by_source"]) == set(result["em_by_source"])
    assert set(result["em_by_source"]) <= {"synthetic_1hop", "synthetic_2hop"}
    # --samples: 2 sampled rollouts per question, paired with the run's sampled evaluation
    assert result["sampled"]["samples"] == 2 and result["samples"] == 1
    assert set(result["sampled"]["correct"]) == set(result["correct"])
    assert all(v in (0.0, 0.5, 1.0) for v in result["sampled"]["correct"].values())
    assert result["change_sampled"]["all"]["n"] == 4
    assert "sampled EM (2 samples per question), paired" in stdout
    assert "all" in stdout


@pytest.mark.e2e  # the second test command
@pytest.mark.slow
def test_a_driver_killed_mid_run_resumes_from_its_last_checkpoint(ray_cluster, tmp_path):
    """SIGKILL the driver of a run that checkpoints every step, once step 2 is logged:
    its actors go with it, the newest checkpoint is whole, and --resume finishes the run
    from there: the same final step, each step's groups trained once in the final
    weights' lineage."""
    from ray._private.state import actors  # the GCS's table: no dashboard needed

    def alive():
        return sum(a["State"] == "ALIVE" for a in actors().values())

    before = alive()
    args = [
        *SMALL, "--output_dir", str(tmp_path), "--wandb", "disabled", "--pipeline.steps", "4",
        "--pipeline.checkpoint_every", "1", "--eval.enabled", "false",
    ]  # fmt: skip
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    out = tmp_path / "tspo"
    log = (tmp_path / "driver.log").open("w")  # a file, not a pipe nobody drains
    driver = subprocess.Popen(
        [sys.executable, str(ROOT / "pipelines" / "tspo.py"), *args],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and driver.poll() is None:
        metrics = out / "metrics.jsonl"
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]  # mid-run
    driver.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    driver.wait(timeout=30)
    log.close()
    deadline = time.monotonic() + 60  # Ray reaps a dead driver's actors
    while alive() > before and time.monotonic() < deadline:
        time.sleep(1)
    assert alive() == before
    kept = [step for step, _ in checkpoints(out / "checkpoint")]
    assert 1 <= len(kept) <= 2 and kept == list(range(kept[0], kept[-1] + 1))  # the newest 2
    state = json.loads((resolve_checkpoint(out / "checkpoint") / "pipeline.json").read_text())
    assert state["step"] == kept[-1] <= 3  # the newest whole checkpoint

    stdout = run("tspo.py", [*args, "--resume", str(out / "checkpoint")], ray_cluster)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["groups_trained"] == 8
    print(
        f"\nRECOVERY the driver, SIGKILLed after step {state['step'] + 1}: actors reaped and "
        f"the run resumed from step {state['step']} and finished {time.monotonic() - killed_at:.0f}"
        f" s after the kill ({summary['seconds']:.0f} s of it the resumed run's own)"
    )
    # the killed run's rows after its checkpoint are dropped: those steps were trained again
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["pipeline/step"] for r in rows] == [1, 2, 3, 4] and "step 4/4" in stdout


@pytest.mark.e2e  # a whole run with a judge model: the second test command
@pytest.mark.slow
def test_search_p1_with_an_llm_judge_makes_plans_and_scores_paths(ray_cluster, tmp_path):
    """Search-P1 with an LLM judge (a tiny random model, guided into the reply's form):
    reference plans are made before training and kept, every trajectory is evaluated
    against its question's plan, and the estimator reads non-null planner scores."""
    args = [
        *SMALL, "--pipeline.steps", "1", "--output_dir", str(tmp_path), "--wandb", "disabled",
        "--eval.enabled", "false", "--judge.backend", "hf", "--judge.model", "tiny-random",
        "--resources.judge_cpus", "0.5",
    ]  # fmt: skip
    stdout = run("search_p1.py", args, ray_cluster)
    assert "reference plans:" in stdout
    out = tmp_path / "search_p1"
    plans = [json.loads(line) for line in (out / "reference_plans.jsonl").read_text().splitlines()]
    assert plans and all(p["reference_plan"] for p in plans)  # guided: every plan parses
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trajectories = row["gen/trajectories"]
    assert row["judge/requests"] == trajectories and row.get("judge/no_evidence", 0) == 0
    assert row.get("judge/unparseable", 0) == 0
    assert row["search_p1/evaluator_missing"] == 0  # every trajectory has its planner score
    assert row["time/stage_search_p1_evaluation_s"] > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["departures"] == [] and summary["config"]["learner"]["loss"]["clip_high"] == 0.28


@pytest.mark.e2e  # a whole run with an info-gain scorer: the second test command
@pytest.mark.slow
def test_a2tgpo_pipeline_trains_at_turn_level(ray_cluster, tmp_path):
    args = [*SMALL, "--pipeline.steps", "1", "--output_dir", str(tmp_path), "--wandb", "disabled",
            "--eval.enabled", "false"]  # fmt: skip
    run("a2tgpo.py", args, ray_cluster)
    summary = json.loads((tmp_path / "a2tgpo" / "summary.json").read_text())
    loss = summary["config"]["learner"]["loss"]
    assert (loss["ratio_level"], loss["clip_low"], loss["clip_high"]) == ("turn", 0.003, 0.004)
    assert summary["config"]["info_gain"]["mode"] == "log_prob_diff"
    last = summary["final_step_metrics"]
    assert last["scorer/forward_rows"] > 0 and "learner/clipfrac" in last


@pytest.mark.e2e  # a whole run, in process: the second test command
@pytest.mark.slow
def test_train_runs_the_users_stages_around_the_methods_estimator(ray_cluster, tmp_path):
    """train(cfg, "tspo", stages=..., stages_after=...): the user's stage before TSPO's
    estimator sees the signals, the one after it sees the advantages, their metrics join
    the step's, and the run lists them among its departures from TSPO's recipe."""
    import numpy as np

    from ray_credit import load_config, train
    from ray_credit.pipeline.cli import run_config_class

    def before(batch):
        assert "turn_contains_gold" in batch and "turn_advantages" not in batch
        return batch.with_metrics({"user/before_turns": float(batch.num_turns)})

    def after(batch):
        advantages = batch.turn_values("turn_advantages")
        return batch.with_turn_columns(
            {"turn_advantages": 2.0 * advantages},
            metrics={"user/after_turns": float(len(advantages))},
        )

    run = run_config_class(ROOT / "pipelines" / "tspo.py", "TSPORun")
    cfg = load_config(run, "tspo", [
        *SMALL, "--pipeline.steps", "1", "--eval.enabled", "false",
        "--output_dir", str(tmp_path), "--wandb", "disabled",
    ])  # fmt: skip
    summary = train(cfg, "tspo", stages=[before], stages_after=[after])
    last = summary["final_step_metrics"]
    assert last["user/before_turns"] == last["user/after_turns"] == last["gen/turns"] > 0
    assert summary["departures"] == [
        "stage 'before' of your own, before the estimator",
        "stage 'after' of your own, after the estimator",
    ]
    assert np.isfinite(last["learner/loss"])


@pytest.mark.e2e  # a whole run of eval.py: the second test command
def test_eval_scores_every_question_of_a_question_file(ray_cluster, tmp_path):
    """pipelines/eval.py on a 53-question test file and its corpus, no --split: no
    training run's split applies, so all 53 are evaluated, each once."""
    from ray_credit.data import WorldConfig, make_world

    world = make_world(WorldConfig(num_entities=20))
    questions = list(world.questions)[:53]
    assert len(questions) == 53
    (tmp_path / "test.jsonl").write_text("".join(
        json.dumps({"question": q["question"], "golden_answers": list(q["golden_answers"])}) + "\n"
        for q in questions
    ))  # fmt: skip
    (tmp_path / "corpus.jsonl").write_text("".join(
        json.dumps({"id": d["id"], "contents": d["contents"]}) + "\n" for d in world.corpus
    ))  # fmt: skip
    result_file = tmp_path / "eval.json"
    # the run's own settings (a question file is refused with the embedded demo's)
    (tmp_path / "settings.yaml").write_text("retriever: {encoder: {name: minilm}}\n")
    stdout = run(
        "eval.py",
        [
            "--config", str(tmp_path / "settings.yaml"),
            "--model", "tiny-random", "--generator.backend", "transformers",
            "--data.questions", str(tmp_path / "test.jsonl"),
            "--data.corpus", str(tmp_path / "corpus.jsonl"),
            "--generator.max_new_tokens", "8", "--generator.max_turns", "2",
            "--resources.num_generators", "2", "--resources.generator_cpus", "0.5",
            "--output", str(result_file),
        ],
        ray_cluster,
    )  # fmt: skip
    assert "evaluating 53 questions: split all" in stdout
    result = json.loads(result_file.read_text())
    assert result["split"] == "all" and result["questions"] == 53
    assert len(result["correct"]) == 53


@pytest.mark.e2e  # two trainings with a judge and an info-gain scorer: the second command
@pytest.mark.slow
def test_two_compositions_no_paper_ran_train_through_the_pipeline(ray_cluster, tmp_path):
    """pipelines/compose.py --estimator TEXT, as users run it: CW-GRPO's judged
    contribution over TSPO's latent reward plus the outcome (the judge runs as a stage),
    and TSPO's latent reward plus A²TGPO's information-gain term (the scorer runs as a
    stage); each trains, its parts' counters are in the step's metrics, and the summary
    names the composition and keeps the recipe (no departure)."""
    compositions = {
        "judged": "outcome + 0.5*folr(groups='all') | turn_position | contribution",
        "gain": "(folr | turn_position) + 0.3*(info_gain(mode='log_prob_diff') | "
        "turn_position(padding='none') | rescaled_sum)",
    }
    for name, text in compositions.items():
        args = [*SMALL, "--pipeline.steps", "1", "--output_dir", str(tmp_path), "--wandb",
                "disabled", "--eval.enabled", "false", "--name", name, "--estimator", text]  # fmt: skip
        run("compose.py", args, ray_cluster)
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["estimator"] == text and summary["departures"] == []
        last = summary["final_step_metrics"]
        assert np.isfinite(last["learner/loss"]) and last["gen/turns"] > 0
        assert "folr/partial_reward_turns" in last
        if name == "judged":
            assert last["time/stage_cw_grpo_judgement_s"] > 0  # the judge ran as a stage
            assert "contribution/redistributed_trajs" in last
        else:
            assert last["scorer/forward_rows"] > 0
            assert summary["config"]["info_gain"]["mode"] == "log_prob_diff"
