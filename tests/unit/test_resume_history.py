"""A resumed run keeps its history: its settings come from its checkpoint, its evaluation
before training and its metrics rows are kept, and the rows an interrupted run logged
after its checkpoint are dropped (those steps are trained again). The whole resume runs in
tests/ray/test_pipelines.py; these are its parts, without Ray."""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from ray_credit.config import InputError
from ray_credit.log import setup_logging
from ray_credit.pipeline import checkpoint_state
from ray_credit.pipeline.cli import run_config_class
from ray_credit.pipeline.configs import EMBEDDED_CONFIG, WandbConfig, load_config
from ray_credit.pipeline.outputs import Logger, kept_evaluations, read_metrics

ROOT = Path(__file__).resolve().parents[2]
EMBEDDED = EMBEDDED_CONFIG


def _tspo_class():
    return run_config_class(ROOT / "pipelines" / "tspo.py", "TSPORun")


def _checkpoint(folder: Path, step: int, metadata: dict | None) -> Path:
    """The files check_resume_folder asks of a checkpoint: the state and the learner."""
    path = folder / f"step_{step:06d}"
    (path / "learner").mkdir(parents=True)
    state = {"format": 2, "step": step, "policy_version": step}
    if metadata is not None:
        state["metadata"] = metadata
    (path / "pipeline.json").write_text(json.dumps(state))
    return path


def test_resume_takes_the_runs_settings_and_flags_override_them(tmp_path):
    cls = _tspo_class()
    first = load_config(
        cls, "tspo", ["--model", "tiny-random", "--data.eval_questions", "7",
                      "--learner.lr", "3e-5", "--name", "mine"],
        default_config=EMBEDDED,
    )  # fmt: skip
    _checkpoint(tmp_path / "checkpoint", 4, {"run_config": asdict(first)})
    assert checkpoint_state(tmp_path / "checkpoint")["step"] == 4

    resumed = load_config(
        cls, "tspo", ["--resume", str(tmp_path / "checkpoint"), "--pipeline.steps", "20"],
        default_config=EMBEDDED,
    )  # fmt: skip
    assert resumed.model == "tiny-random" and resumed.name == "mine"
    assert resumed.data.eval_questions == 7 and resumed.learner.lr == 3e-5
    assert resumed.pipeline.steps == 20  # given with --resume: it wins
    assert resumed.learner.betas == first.learner.betas  # a tuple, back from JSON's list
    assert resumed.resume == str(tmp_path / "checkpoint")
    # everything else as the first run had it
    assert asdict(replace(resumed, resume=None, pipeline=first.pipeline)) == asdict(first)


def test_a_checkpoint_without_its_runs_settings_resumes_from_the_flags(tmp_path, capsys):
    _checkpoint(tmp_path, 2, None)  # as written before runs saved their settings
    cfg = load_config(_tspo_class(), "tspo", ["--resume", str(tmp_path / "step_000002")],
                      default_config=EMBEDDED)  # fmt: skip
    assert "holds no run config" in capsys.readouterr().out
    assert cfg.data.eval_questions == 120  # the embedded file's, as for a new run


def test_a_checkpoint_of_another_pipeline_is_named(tmp_path):
    _checkpoint(tmp_path, 1, {"run_config": {"no_such_section": {"x": 1}}})
    with pytest.raises(InputError, match="run config does not fit this pipeline"):
        load_config(_tspo_class(), "tspo", ["--resume", str(tmp_path)])
    with pytest.raises(InputError, match="no such folder"):
        load_config(_tspo_class(), "tspo", ["--resume", str(tmp_path / "nowhere")])


def test_evaluations_are_kept_only_when_what_decides_them_is_unchanged(capsys):
    config = {"model": "m", "data": {"eval_questions": 4}, "generator": {"topk": 1},
              "retriever": {}, "eval": {}, "warm_start": {}, "learner": {"lr": 1e-5}}  # fmt: skip
    previous = {"config": config, "eval_before": {"em": 0.5}, "eval_base": {"em": 0.0}}
    more_steps = {**config, "learner": {"lr": 2e-5}}  # training settings may change
    assert kept_evaluations(previous, more_steps) == {
        "eval_before": {"em": 0.5}, "eval_base": {"em": 0.0}
    }  # fmt: skip
    # as the run's settings are (a tuple), against summary.json's (a list): unchanged
    hops = {**config, "warm_start": {"hops": [1, 2]}}
    assert kept_evaluations({**previous, "config": hops},
                            {**hops, "warm_start": {"hops": (1, 2)}})["eval_before"] == {"em": 0.5}  # fmt: skip
    other_data = {**config, "data": {"eval_questions": 8}}
    assert kept_evaluations(previous, other_data) == {}
    assert "changes data" in capsys.readouterr().out


class _Run:  # the fields Logger reads of a run config
    name = "run"
    wandb = WandbConfig(mode="disabled")
    learner = SimpleNamespace(kl_coef=0.0)


def _rows(path: Path) -> list[float]:
    return [r["pipeline/step"] for r in read_metrics(path)]


def test_a_resumed_logger_drops_the_rows_after_the_checkpoint(tmp_path):
    logger = Logger(_Run(), tmp_path)
    for step in (1, 2, 3):
        logger.step({"pipeline/step": step, "train/reward_mean": step / 10}, total=5)
    logger.finish()
    with (tmp_path / "metrics.jsonl").open("a") as file:
        file.write('{"pipeline/step": 4, "train/rew')  # a killed run's last line

    resumed = Logger(_Run(), tmp_path, resumed_step=2)  # its checkpoint was step 2
    assert [r["pipeline/step"] for r in resumed.rows] == [1, 2]  # the plot's history
    resumed.step({"pipeline/step": 3, "train/reward_mean": 0.9}, total=5)
    resumed.finish()
    assert _rows(tmp_path / "metrics.jsonl") == [1, 2, 3]  # step 3 once: the new one
    assert read_metrics(tmp_path / "metrics.jsonl")[-1]["train/reward_mean"] == 0.9

    fresh = Logger(_Run(), tmp_path)  # a new run in the same folder starts afresh
    fresh.finish()
    assert _rows(tmp_path / "metrics.jsonl") == []


def test_the_progress_line_tells_the_kl_to_the_reference_from_the_samplers_drift(tmp_path, capsys):
    setup_logging("info")
    row = {"pipeline/step": 1, "learner/kl": 3e-4, "learner/approx_kl": -8e-4}
    plain = Logger(_Run(), tmp_path)
    plain.step(row, total=2)
    plain.finish()
    line = capsys.readouterr().out
    assert "approx_kl -8.00e-04" in line and "kl_ref" not in line  # no reference, no KL loss

    class _WithReference(_Run):
        learner = SimpleNamespace(kl_coef=1e-3)

    with_kl = Logger(_WithReference(), tmp_path)
    with_kl.step(row, total=2)
    assert "kl_ref 3.00e-04  approx_kl -8.00e-04" in capsys.readouterr().out
    # an update with an exactly zero gradient measured neither: not printed as 0
    with_kl.step({"pipeline/step": 2, "learner/loss": 0.0}, total=2)
    with_kl.finish()
    assert "kl_ref -  approx_kl -  " in capsys.readouterr().out


def test_a_damaged_metrics_row_is_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"pipeline/step": 1}\nnot json\n{"pipeline/step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON metrics row"):
        read_metrics(path)
    path.write_text('{"step": 1}\n')
    with pytest.raises(ValueError, match="no pipeline/step"):
        read_metrics(path)


def test_the_storage_folder_holds_the_runs_outputs_and_a_new_head_fetches_them(tmp_path):
    from ray_credit.pipeline.outputs import sync_outputs
    from ray_credit.storage import StoragePath

    head = tmp_path / "head" / "run"
    head.mkdir(parents=True)
    (head / "summary.json").write_text('{"steps": 2}')
    (head / "metrics.jsonl").write_text('{"pipeline/step": 1}\n')
    storage = StoragePath(f"file://{tmp_path}/bucket/run")
    sync_outputs(head, storage)
    assert (tmp_path / "bucket" / "run" / "summary.json").read_text() == '{"steps": 2}'
    assert not (tmp_path / "bucket" / "run" / "plot.png").exists()  # not made yet

    new_head = tmp_path / "new_head" / "run"  # a resume on another machine
    new_head.mkdir(parents=True)
    (new_head / "summary.json").write_text('{"steps": 3}')  # what is here is kept
    sync_outputs(new_head, storage, fetch=True)
    assert (new_head / "metrics.jsonl").read_text() == '{"pipeline/step": 1}\n'
    assert (new_head / "summary.json").read_text() == '{"steps": 3}'


def test_a_storage_path_that_cannot_be_written_is_refused_before_ray(tmp_path):
    from ray_credit.pipeline.outputs import run_storage

    cls = _tspo_class()
    (tmp_path / "a_file").write_text("")
    for where, reason in [("nosuch://bucket/runs", "pyarrow cannot open"),
                          (str(tmp_path / "a_file"), "cannot write there")]:  # fmt: skip
        cfg = cls(storage_path=where)
        with pytest.raises(InputError, match=f"storage_path=.*{reason}.*s3://bucket/runs"):
            run_storage(cfg, tmp_path / "out")
    assert str(run_storage(cls(name="mine"), tmp_path / "out")) == str(tmp_path / "out")
    with pytest.raises(ValueError, match="storage_path must be a path or a URI"):
        cls(storage_path=" ")


def test_an_evaluation_made_where_a_run_resumed_says_at_which_step(monkeypatch, tmp_path, capsys):
    """A resume that cannot keep its first start's evaluation evaluates the resumed policy
    and marks it with the step, which the paired change then names."""
    import ray_credit.pipeline.recipe as recipe
    from ray_credit.pipeline.evaluation import report_change

    def evaluation(em):
        return {"em": em, "correct": {"0": em}, "source": {"0": "nq"}, "em_by_source": {"nq": em}}

    monkeypatch.setattr(recipe, "evaluate_policy", lambda *a: evaluation(1.0))
    logged = []
    logger = SimpleNamespace(log=lambda metrics, step: logged.append(step))
    outputs = SimpleNamespace(summary={}, logger=logger, out=tmp_path)
    cfg = SimpleNamespace(eval=SimpleNamespace(enabled=True))
    recipe._evaluate_before(cfg, None, None, [{}], outputs, 7, ())
    before = outputs.summary["eval_before"]
    assert before["step"] == 7 and logged == [7]
    outputs.summary["eval_after"] = evaluation(0.0)
    report_change(outputs.summary, logger, 10)
    assert "from step 7 (where the run was resumed), not its start" in capsys.readouterr().out


def test_reference_plans_cut_off_while_written_are_made_again(tmp_path, capsys):
    """A run killed while appending a reference plan leaves half a line: the next start
    removes it and asks the judge for that question's plan again, and its line starts on a
    line of its own. Another unreadable line is refused with the file and line."""
    from ray_credit.pipeline.configs import JudgeConfig
    from ray_credit.pipeline.questions import judge_identity
    from ray_credit.pipeline.questions import with_reference_plans as with_plans

    asked = []

    class Judges:
        def judge(self, signal, questions):
            asked.extend(q["question"] for q in questions)
            return [{"reference_plan": [f"find {q['question']}"]} for q in questions]

    plan = SimpleNamespace(question_signals=("reference_plan",))
    questions = [{"question": "a?"}, {"question": "b?"}]
    cache = tmp_path / "reference_plans.jsonl"
    judge = judge_identity(JudgeConfig(backend="hf", model="smollm2-135m"))
    with_reference_plans = functools.partial(with_plans, made_by=judge)
    plan_a = json.dumps({"question": "a?", "reference_plan": ["find a?"], "judge": judge})
    cache.write_text(plan_a + '\n{"quest')
    out = with_reference_plans(plan, Judges(), questions, cache)
    assert asked == ["b?"] and [q["reference_plan"] for q in out] == [["find a?"], ["find b?"]]
    assert "last line was cut off (7 characters" in capsys.readouterr().out
    assert [json.loads(line)["question"] for line in cache.read_text().splitlines()] == ["a?", "b?"]
    whole = json.dumps({"question": "b?", "reference_plan": ["find b?"], "judge": judge})
    cache.write_text(whole)  # whole, its newline missing: kept
    assert [q["reference_plan"] for q in with_reference_plans(plan, Judges(), questions, cache)
            ] == [["find a?"], ["find b?"]] and asked == ["b?", "a?"]  # fmt: skip
    assert cache.read_text().startswith(whole + "\n")  # the next plan on a line of its own
    cache.write_text("not json\n")
    with pytest.raises(InputError, match=r"reference_plans\.jsonl:1: not a reference plan"):
        with_reference_plans(plan, Judges(), questions, cache)


def test_reference_plans_of_another_judge_are_made_again(tmp_path, capsys):
    """A run resumed with another judge model (or a cache kept before it named its judge)
    asks its own judge for the plans: another judge's are not reused."""
    from ray_credit.pipeline.configs import JudgeConfig
    from ray_credit.pipeline.questions import judge_identity, with_reference_plans

    class Judges:
        def judge(self, signal, questions):
            return [{"reference_plan": [f"new {q['question']}"]} for q in questions]

    plan = SimpleNamespace(question_signals=("reference_plan",))
    questions = [{"question": "a?"}, {"question": "b?"}]
    small = judge_identity(JudgeConfig(backend="hf", model="smollm2-135m"))
    large = judge_identity(JudgeConfig(backend="hf", model="Qwen/Qwen2.5-7B-Instruct"))
    cache = tmp_path / "reference_plans.jsonl"
    cache.write_text(
        json.dumps({"question": "a?", "reference_plan": ["small a?"], "judge": small}) + "\n"
        + json.dumps({"question": "b?", "reference_plan": ["old b?"]}) + "\n"  # judge unnamed
    )  # fmt: skip
    out = with_reference_plans(plan, Judges(), questions, cache, made_by=large)
    assert [q["reference_plan"] for q in out] == [["new a?"], ["new b?"]]
    assert "2 reference plans" in capsys.readouterr().out
    again = with_reference_plans(plan, Judges(), questions, cache, made_by=small)
    assert [q["reference_plan"] for q in again] == [["small a?"], ["new b?"]]
    assert judge_identity(JudgeConfig(backend="hf", model="smollm2-135m")) == small != large
    # guided decoding as it applies: unset is on for hf
    assert judge_identity(JudgeConfig(backend="hf", model="smollm2-135m", guided=True)) == small
    served = JudgeConfig(backend="openai", model="judge", base_url="http://a:8000/v1")
    moved = JudgeConfig(backend="openai", model="judge", base_url="http://b:8000/v1")
    assert judge_identity(served) != judge_identity(moved)
