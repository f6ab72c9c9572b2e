"""bench/learning.py --quick: the study's machinery (runs, aggregation, JSON, plot) on a
tiny model, against the shared cluster. The study itself runs once, not in CI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e  # two training runs of the study, end to end: the second test command
@pytest.mark.bench
@pytest.mark.slow
def test_learning_bench_quick(ray_cluster, tmp_path):
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "learning.py"), "--quick",
         "--methods", "grpo,tspo", "--out", str(tmp_path / "learning.json"),
         "--runs-dir", str(tmp_path / "runs")],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    # the methods of a seed start from one warm-start: made by the first, reused by the next
    assert out.stdout.count("warm-start: saved in") == 1 and "warm-start: reused" in out.stdout
    # and the warm-started policy's evaluation: run by the first, read by the next
    assert out.stdout.count("the greedy evaluation of the same policy, questions") == 1
    report = json.loads((tmp_path / "learning.json").read_text())
    assert set(report["methods"]) == {"grpo", "tspo"} and report["seeds"] == [0]
    for method in ("grpo", "tspo"):
        (run,) = report["runs"][method]
        assert len(run["reward"]) == 1 and 0 <= run["em_after"] <= 1
        assert run["em_change"]["n"] == 4  # the 4 held-out questions, paired
        agg = report["methods"][method]
        # one seed: the interval is its questions' (a bootstrap over them)
        assert agg["em_after"]["n"] == 1
        assert agg["em_after"]["low"] <= run["em_after"] <= agg["em_after"]["high"]
        assert 0 < run["rl_seconds"] < run["seconds"]  # the loop, without warm-start and evals
    assert (tmp_path / "learning.png").stat().st_size > 1000
    # a recorded run keeps its figures, not its checkpoint (GBs per run at real sizes)
    assert (tmp_path / "runs" / "grpo-seed0" / "summary.json").is_file()
    assert not (tmp_path / "runs" / "grpo-seed0" / "checkpoint").exists()
    assert "EM after [95% CI]" in out.stdout and (tmp_path / "learning.md").is_file()


def test_t_interval_and_quantiles():
    sys.path.insert(0, str(ROOT / "bench"))
    from learning import _interval, _t975

    assert _t975(2) == 4.303 and _t975(12) == 2.228 and abs(_t975(60) - 2.000) < 0.002
    agg = _interval([0.1, 0.2, 0.3])
    assert agg["mean"] == 0.2 and abs(agg["high"] - 0.2 - 4.303 * 0.1 / 3**0.5) < 1e-9


def test_study_records_runs_and_resumes(tmp_path, monkeypatch, capsys):
    """Each finished run is recorded as it ends; a restarted study reuses those and redoes
    only the rest, and refuses a record made with other settings."""
    sys.path.insert(0, str(ROOT / "bench"))
    import learning

    calls = []

    def fake_run(method, seed, settings, runs_dir, config=None, composition=None):
        calls.append((method, seed))
        if len(calls) == 3 and fail["now"]:
            raise RuntimeError("machine lost")
        change = {"diff": seed / 10, "low": -1, "high": 1}
        return {"seed": seed, "seconds": 1.0, "em_before": 0.5, "em_after": 0.5 + seed / 10,
                "em_before_by_source": {"1hop": 0.5}, "em_after_by_source": {"1hop": 0.5},
                "em_change": change, "em_change_by_source": {"1hop": change},
                "searches_before": 1.0, "searches_after": 1.5, "reward": [0.1, 0.2],
                "groups_all_wrong": [0.5, 0.5], "groups_zero_advantage": [0.5, 0.5],
                "estimator_counters": {},
                **({"estimator": composition} if composition else {})}  # fmt: skip

    fail = {"now": True}
    monkeypatch.setattr(learning, "run_one", fake_run)
    monkeypatch.setattr(learning, "plot_curves", lambda report, path: path.write_text("png"))
    argv = ["--methods", "grpo,tspo", "--seeds", "0,1", "--set", "pipeline.steps=2",
            "--runs-dir", str(tmp_path / "runs"), "--out", str(tmp_path / "l.json")]  # fmt: skip
    with pytest.raises(RuntimeError, match="machine lost"):
        learning.main(argv)
    assert calls == [("grpo", 0), ("tspo", 0), ("grpo", 1)]  # seed-major
    record = (tmp_path / "runs" / "runs.jsonl").read_text().splitlines()
    assert [json.loads(r)["method"] for r in record] == ["grpo", "tspo"]
    with (tmp_path / "runs" / "runs.jsonl").open("a") as f:
        f.write('{"method": "grpo", "se')  # a record cut off while written
    fail["now"], calls[:] = False, []
    assert learning.main(argv) == 0
    assert calls == [("grpo", 1), ("tspo", 1)]  # only what was not finished
    # the fragment was cut away before the new records were appended: all four are whole
    record = tmp_path / "runs" / "runs.jsonl"
    fingerprint = learning.defaults_fingerprint()
    assert len(learning.recorded_runs(record, ["pipeline.steps=2"], fingerprint)) == 4
    out = capsys.readouterr().out
    assert out.count("reused from") == 2 and "not a whole record" in out
    report = json.loads((tmp_path / "l.json").read_text())
    assert [r["seed"] for r in report["runs"]["tspo"]] == [0, 1]
    assert report["methods"]["tspo"]["em_after"]["n"] == 2
    # --report recomputes the tables from the record alone: nothing runs, the same figures
    calls[:] = []
    again = ["--methods", "grpo,tspo", "--seeds", "0,1", "--out", str(tmp_path / "r.json")]
    assert learning.main([*again, "--report", str(record)]) == 0 and calls == []
    recomputed = json.loads((tmp_path / "r.json").read_text())
    assert recomputed["methods"] == report["methods"]
    with pytest.raises(SystemExit):
        learning.main([*again, "--report", str(tmp_path / "nowhere.jsonl")])
    assert "nowhere.jsonl: no such study record" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        learning.main([*argv[:-4], "--set", "pipeline.steps=3", *argv[-4:]])
    assert "give the same --set" in capsys.readouterr().err
    # the same --set on other embedded settings (embedded.yaml edited since) is another study
    monkeypatch.setattr(learning, "defaults_fingerprint", lambda config: "0123456789abcdef")
    with pytest.raises(SystemExit):
        learning.main(argv)
    assert "recorded from other starting settings" in capsys.readouterr().err
    monkeypatch.undo()
    monkeypatch.setattr(learning, "run_one", fake_run)
    monkeypatch.setattr(learning, "plot_curves", lambda report, path: path.write_text("png"))
    with (tmp_path / "runs" / "runs.jsonl").open("a") as f:
        f.write("[1, 2]\n")
    with pytest.raises(SystemExit):
        learning.main(argv)
    assert "runs.jsonl:5: not a run record of this study" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        learning.main([*argv, "--set", "name=x"])
    assert "the study names and places its runs" in capsys.readouterr().err


def test_a_record_carried_to_a_new_machine_goes_on_only_from_its_runs_start(
    tmp_path, monkeypatch, capsys
):
    """The record alone moves a study to another machine: its runs are reused, the rest
    run there. A run whose warm-start (made again there) has other weights, or whose
    evaluation before training differs, is refused, before training where the warm-start
    is already on disk, and the report refuses a seed whose runs started apart."""
    sys.path.insert(0, str(ROOT / "bench"))
    import learning

    from ray_credit.warm_start import weights_digest

    calls, made = [], {"weights": b"first machine", "correct": [1, 0, 1]}

    def fake_run(method, seed, settings, runs_dir, config=None, composition=None):
        calls.append((method, seed))
        (runs_dir / learning.run_name(method, seed)).mkdir(parents=True, exist_ok=True)
        folder = runs_dir / f"warm_start-seed{seed}"
        if not (folder / "warm_start.json").is_file():  # made by the run, as train does
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "model.safetensors").write_bytes(made["weights"])
            (folder / "warm_start.json").write_text("{}")
        change = {"diff": 0.0, "low": 0.0, "high": 0.0}
        return {"seed": seed, "seconds": 1.0, "em_before": 0.5, "em_after": 0.5,
                "em_before_by_source": {"1hop": 0.5}, "em_after_by_source": {"1hop": 0.5},
                "em_change": change, "em_change_by_source": {"1hop": change},
                "searches_before": 1.0, "searches_after": 1.0, "reward": [0.1],
                "groups_all_wrong": [0.5], "groups_zero_advantage": [0.5],
                "estimator_counters": {}, "correct_before": made["correct"],
                "correct_after": made["correct"], "source": ["1hop"] * 3,
                "warm_start_sha256": weights_digest(folder)}  # fmt: skip

    monkeypatch.setattr(learning, "run_one", fake_run)
    monkeypatch.setattr(learning, "plot_curves", lambda report, path: path.write_text("png"))
    first, second = tmp_path / "first", tmp_path / "second"

    def study(runs, methods="grpo,tspo"):
        return learning.main(["--methods", methods, "--seeds", "0", "--runs-dir", str(runs),
                              "--out", str(runs / "l.json")])  # fmt: skip

    assert study(first, "grpo") == 0 and calls == [("grpo", 0)]
    second.mkdir()
    (second / "runs.jsonl").write_text((first / "runs.jsonl").read_text())  # the record alone
    made["weights"] = b"second machine"  # the same settings, other weights
    with pytest.raises(SystemExit):
        study(second)
    err = capsys.readouterr().err
    assert "tspo seed 0 does not start where the recorded runs of seed 0 did" in err
    assert "its warm-start's weights" in err and "are not those grpo started from" in err
    assert calls[-1] == ("tspo", 0) and "tspo" not in (second / "runs.jsonl").read_text()
    (aside,) = second.glob("tspo-seed0.refused-*")  # set aside, named: never resumed
    assert str(aside) in err and not (second / "tspo-seed0").exists()
    calls.clear()
    with pytest.raises(SystemExit):  # the warm-start is now on disk: refused before training
        study(second)
    assert calls == [] and "does not start where" in capsys.readouterr().err
    # the first machine's warm-start brought along: the study goes on from the record
    (second / "warm_start-seed0" / "model.safetensors").write_bytes(b"first machine")
    assert study(second) == 0 and calls == [("tspo", 0)]
    report = json.loads((second / "l.json").read_text())
    assert [r["seed"] for r in report["runs"]["tspo"]] == [0]
    # the same weights but another evaluation before training: not one start either
    made["correct"] = [0, 0, 1]
    (tmp_path / "third").mkdir()
    (tmp_path / "third" / "runs.jsonl").write_text((first / "runs.jsonl").read_text())
    (tmp_path / "third" / "warm_start-seed0").mkdir()
    (tmp_path / "third" / "warm_start-seed0" / "model.safetensors").write_bytes(b"first machine")
    (tmp_path / "third" / "warm_start-seed0" / "warm_start.json").write_text("{}")
    with pytest.raises(SystemExit):
        study(tmp_path / "third")
    err = capsys.readouterr().err
    assert "evaluation before training answered other questions right" in err
    assert "its warm-start's weights are theirs" in err and "bring the" not in err
    # a record made before runs kept their warm-start's digest: compared by evaluation only
    made["correct"] = [1, 0, 1]
    old = tmp_path / "old"
    old.mkdir()
    rows = [json.loads(line) for line in (first / "runs.jsonl").read_text().splitlines()]
    (old / "runs.jsonl").write_text("".join(
        json.dumps({k: v for k, v in r.items() if k != "warm_start_sha256"}) + "\n" for r in rows
    ))  # fmt: skip
    calls.clear()
    assert study(old) == 0 and calls == [("tspo", 0)]
    with pytest.raises(SystemExit):  # the study places each seed's warm-start itself
        learning.main(["--set", "warm_start.folder=/elsewhere", "--runs-dir", str(old)])
    assert "the study names and places its runs" in capsys.readouterr().err
    # a record whose runs of one seed started apart is refused by --report
    lines = (second / "runs.jsonl").read_text().splitlines()
    tspo = json.loads(lines[1])
    tspo["warm_start_sha256"] = "f" * 64
    (tmp_path / "mixed.jsonl").write_text(lines[0] + "\n" + json.dumps(tspo) + "\n")
    with pytest.raises(SystemExit):
        learning.main(["--methods", "grpo,tspo", "--seeds", "0", "--out",
                       str(tmp_path / "m.json"), "--report", str(tmp_path / "mixed.jsonl")])  # fmt: skip
    assert "they are not one study's runs" in capsys.readouterr().err


def test_a_run_cut_off_continues_from_its_newest_checkpoint(tmp_path, monkeypatch, capsys):
    """A study's runs save a checkpoint every step; an unfinished run's folder is resumed
    from its newest whole checkpoint (the record lists the starts), and one without a
    checkpoint is cleared and run afresh."""
    sys.path.insert(0, str(ROOT / "bench"))
    import learning

    import ray_credit.pipeline.recipe as recipe

    seen = []

    def fake_train(cfg, estimator):
        seen.append(cfg)
        out = Path(cfg.output_dir) / cfg.name
        out.mkdir(parents=True, exist_ok=True)
        starts = [{"resumed_from": None}] + ([{"resumed_from": cfg.resume}] if cfg.resume else [])
        (out / "summary.json").write_text(json.dumps({"starts": starts}))

    monkeypatch.setattr(recipe, "train", fake_train)
    monkeypatch.setattr(learning, "collect", lambda folder, method: {"em_after": 0.5})
    checked = []
    monkeypatch.setattr(learning, "_check_same_start", lambda folder, cfg: checked.append(folder))
    runs = tmp_path / "runs"
    cut = runs / "grpo-seed0" / "checkpoint"
    for step in (1, 2):
        (cut / f"step_00000{step}" / "learner").mkdir(parents=True)
        (cut / f"step_00000{step}" / "pipeline.json").write_text(json.dumps({"step": step}))
    (cut / "step_000003" / "learner").mkdir(parents=True)  # a save cut off: no pipeline.json
    run = learning.run_one("grpo", 0, ["pipeline.steps=4"], runs)
    assert seen[-1].resume == str(cut / "step_000002")
    assert seen[-1].pipeline.checkpoint_every == 1 and seen[-1].pipeline.keep_checkpoints == 1
    assert run["starts"] == [None, str(cut / "step_000002")]
    assert run["seconds"] is None and run["last_start_seconds"] >= 0  # the cut start's: unknown
    assert "resumed from its checkpoint after step 2" in capsys.readouterr().out
    assert checked == [runs.resolve() / "grpo-seed0"]  # its start checked before it trains
    early = runs / "tspo-seed0"
    (early / "metrics.jsonl").parent.mkdir(parents=True)
    (early / "metrics.jsonl").write_text("{}\n")  # cut off before its first checkpoint
    run = learning.run_one("tspo", 0, ["pipeline.steps=4"], runs)
    assert seen[-1].resume is None and "starts" not in run
    assert not (early / "metrics.jsonl").exists()  # cleared, not appended to
    assert "before its first checkpoint; redone" in capsys.readouterr().out
    assert len(checked) == 1  # nothing to check on a run started afresh


def test_a_run_is_resumed_only_where_its_change_stays_measured_from_its_start(tmp_path):
    """Before a resumed run trains: its first start's evaluation before training must be
    kept (same evaluation settings, made before its first step), else it is refused."""
    sys.path.insert(0, str(ROOT / "bench"))
    from dataclasses import asdict

    import learning

    from ray_credit.pipeline.cli import run_config_class
    from ray_credit.pipeline.configs import load_config

    run_cls = run_config_class(ROOT / "pipelines" / "grpo.py", "GRPORun")
    cfg = load_config(run_cls, "grpo", [], default_config=ROOT / "pipelines/configs/sparse.yaml")
    folder = tmp_path / "grpo-seed0"
    folder.mkdir()

    def first_start(config, eval_before):
        summary = {"config": json.loads(json.dumps(asdict(config), default=str)),
                   "eval_before": eval_before}  # fmt: skip
        (folder / "summary.json").write_text(json.dumps(summary))

    first_start(cfg, {"em": 0.4})
    learning._check_same_start(folder, cfg)  # as it started: goes on
    first_start(cfg, {"em": 0.4, "step": 7})
    with pytest.raises(ValueError, match="grpo-seed0: its change would not be measured"):
        learning._check_same_start(folder, cfg)
    other = load_config(run_cls, "grpo", ["--data.eval_questions", "80"],
                        default_config=ROOT / "pipelines/configs/sparse.yaml")  # fmt: skip
    first_start(other, {"em": 0.4})
    with pytest.raises(ValueError, match="remove the folder"):
        learning._check_same_start(folder, cfg)


def test_a_run_whose_change_is_not_from_its_start_is_refused(tmp_path):
    """A run resumed with other settings measured its change from where it resumed: the
    study names the folder instead of counting that change as the run's."""
    sys.path.insert(0, str(ROOT / "bench"))
    import learning

    run = tmp_path / "grpo-seed0"
    run.mkdir()
    evaluation = {"em": 0.5, "em_by_source": {"nq": 0.5}}
    summary = {"estimator": "grpo", "eval_before": {**evaluation, "step": 7},
               "eval_after": evaluation, "eval_change": {}}  # fmt: skip
    (run / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ValueError, match="made at step 7, where it was resumed"):
        learning.collect(run, "grpo")


def test_a_study_trains_compositions_of_its_own_on_a_config_of_its_own(tmp_path, monkeypatch,
                                                                      capsys):  # fmt: skip
    """--compose NAME=TEXT adds a method (recorded with its composition: the same name with
    another composition is refused, not reused); --config's file is what every run starts
    from, and its fingerprint keeps other settings' runs apart; a composition that cannot
    work is refused before any run."""
    sys.path.insert(0, str(ROOT / "bench"))
    import learning

    seen = []

    def fake_run(method, seed, settings, runs_dir, config=None, composition=None):
        seen.append((method, config.name, composition))
        change = {"diff": 0.0, "low": -1, "high": 1}
        return {"seed": seed, "seconds": 1.0, "em_before": 0.5, "em_after": 0.5,
                "em_before_by_source": {"3hop": 0.5}, "em_after_by_source": {"3hop": 0.5},
                "em_change": change, "em_change_by_source": {"3hop": change},
                "searches_before": 1.0, "searches_after": 1.0, "reward": [0.1],
                "groups_all_wrong": [0.6], "groups_zero_advantage": [0.6],
                "estimator_counters": {},
                **({"estimator": composition} if composition else {})}  # fmt: skip

    monkeypatch.setattr(learning, "run_one", fake_run)
    monkeypatch.setattr(learning, "plot_curves", lambda report, path: path.write_text("png"))
    sparse = ROOT / "pipelines" / "configs" / "sparse.yaml"
    argv = ["--config", str(sparse), "--seeds", "0", "--methods", "grpo,mine",
            "--compose", "mine=outcome + 0.5*folr | turn_position",
            "--runs-dir", str(tmp_path / "runs"), "--out", str(tmp_path / "l.json")]  # fmt: skip
    assert learning.main(argv) == 0
    assert seen == [("grpo", "sparse.yaml", None),
                    ("mine", "sparse.yaml", "outcome + 0.5*folr | turn_position")]  # fmt: skip
    report = json.loads((tmp_path / "l.json").read_text())
    assert report["compositions"] == {"mine": "outcome + 0.5*folr | turn_position"}
    assert report["methods"]["mine"]["vs_baseline"]["all"] is None  # no per-question data
    other = [a if a != "mine=outcome + 0.5*folr | turn_position" else "mine=outcome | group"
             for a in argv]  # fmt: skip
    with pytest.raises(SystemExit):
        learning.main(other)
    assert "give that method another name" in capsys.readouterr().err
    for bad, says in (("mine=folr | group", "one value per trajectory"),
                      ("grpo=outcome | group", "the papers' names are taken")):  # fmt: skip
        with pytest.raises(SystemExit):
            learning.main([*argv[:7], bad, *argv[8:]])
        assert says in capsys.readouterr().err
    assert learning.defaults_fingerprint(sparse) != learning.defaults_fingerprint()
    # a comment is not a setting: the same settings commented otherwise are the same study
    commented = tmp_path / "commented.yaml"
    commented.write_text("# a note\n" + sparse.read_text().replace("  # ", "  # note: "))
    assert learning.defaults_fingerprint(commented) == learning.defaults_fingerprint(sparse)


def test_pooled_changes_pair_by_seed_and_question():
    """The pooled changes: a pair per (seed, question), from before training or against
    the baseline's EM after training on the same seed; per data source on request."""
    sys.path.insert(0, str(ROOT / "bench"))
    from learning import pooled

    def run(seed, before, after):
        keys = [f"q{i}" for i in range(len(before))]
        return {"seed": seed, "correct_before": dict(zip(keys, before, strict=True)),
                "correct_after": dict(zip(keys, after, strict=True)),
                "source": {k: ("1hop", "2hop")[i % 2] for i, k in enumerate(keys)}}  # fmt: skip

    tspo = [run(0, [0, 0, 1, 1], [1, 1, 1, 0]), run(1, [0, 1, 0, 1], [1, 1, 1, 1])]
    grpo = [run(0, [0, 0, 1, 1], [0, 1, 1, 1]), run(1, [0, 1, 0, 1], [0, 1, 0, 1])]
    change = pooled(tspo)  # seed 0: 2 better, 1 worse; seed 1: 2 better
    assert (change["n"], change["seeds"], change["better"], change["worse"]) == (8, 2, 4, 1)
    # the mean of the seeds' changes (1/4 and 2/4), the interval over seeds and questions
    assert abs(change["diff"] - 3 / 8) < 1e-12 and change["low"] <= change["diff"]
    assert change["p_sign"] is None  # no sign test over two runs' questions pooled
    assert pooled(tspo[:1])["p_sign"] == 1.0  # one seed: 2 up, 1 down: 2 * (1 + 3) / 2^3
    versus = pooled(tspo, grpo)  # seed 0: q0 better, q3 worse; seed 1: q0 and q2 better
    assert (versus["n"], versus["better"], versus["worse"]) == (8, 3, 1)
    one_hop = pooled(tspo, source="1hop")  # q0 and q2 of each seed, all four better but one
    assert (one_hop["n"], one_hop["better"], one_hop["worse"]) == (4, 3, 0)
    assert pooled(tspo, [run(7, [0], [1])]) is None  # no seed in common
    assert pooled([{k: v for k, v in tspo[0].items() if k != "correct_after"}]) is None
    other = [run(0, [0, 0, 1, 1, 0], [1, 1, 1, 0, 1])]  # a fifth question grpo never saw
    with pytest.raises(ValueError, match="seed 0: 1 of its 5 held-out questions were not"):
        pooled(other, grpo)


def test_seeds_that_disagree_widen_the_interval_of_the_mean():
    """Three seeds whose changes disagree: their questions pooled as if from one run
    would exclude 0, the interval over seeds and questions does not; the table cell says
    how many questions moved each way, the sign test on them, and when fewer seeds than
    the study's went in."""
    sys.path.insert(0, str(ROOT / "bench"))
    from learning import _change_cell, _paired, pooled

    def run(seed, moved):
        keys = [f"q{i}" for i in range(100)]
        before = [0] * 100
        after = [1] * moved + [0] * (100 - moved) if moved > 0 else before
        if moved < 0:
            before, after = [1] * -moved + [0] * (100 + moved), [0] * 100
        return {"seed": seed, "correct_before": dict(zip(keys, before, strict=True)),
                "correct_after": dict(zip(keys, after, strict=True)),
                "source": dict.fromkeys(keys, "1hop")}  # fmt: skip

    change = pooled([run(0, 10), run(1, -6), run(2, 10)])
    assert abs(change["diff"] - 14 / 300) < 1e-12 and change["low"] < 0 < change["high"]
    agreeing = pooled([run(0, 10), run(1, 8), run(2, 10)])
    assert agreeing["low"] > 0
    assert _paired(agreeing, 3) == (
        f"+0.093 [{agreeing['low']:+.3f}, {agreeing['high']:+.3f}] (28/0)"
    )  # the sign test only on one seed's questions (it too would read three runs as one)
    one = pooled([run(0, 10)])
    assert _paired(one, 1) == f"+0.100 [{one['low']:+.3f}, {one['high']:+.3f}] (10/0, p=0.002)"
    assert _paired(pooled([run(0, 0)]), 3) == "no question changed (n=100, 1 of 3 seeds)"
    unmoved = {"mean": 0.0, "low": 0.0, "high": 0.0}
    agg = {"em_change_pooled": {"all": pooled([run(0, 0)]), "1hop": pooled([run(0, 0)])},
           "em_change": unmoved, "em_change_by_source": {"1hop": unmoved}}  # fmt: skip
    assert _change_cell(agg, "1hop") == _change_cell(agg, "all") == "no question changed"
    agg["em_change_pooled"]["all"] = agreeing
    agg["em_change"] = {"mean": agreeing["diff"], "low": agreeing["low"], "high": agreeing["high"]}
    assert _change_cell(agg, "all").startswith("+0.093 [")


def test_a_setting_is_measured_against_another_studys_runs(tmp_path, monkeypatch, capsys):
    """--against: each method's EM after training minus the same method's in another
    study (other settings), paired on the same seed and question; that study's record is
    read, whatever its settings, and left as it is."""
    sys.path.insert(0, str(ROOT / "bench"))
    import learning

    def fake_run(method, seed, settings, runs_dir, config=None, composition=None):
        lr = settings[0]  # the second study's setting gets one more question of four right
        after = [1, 0, 0, 1] if lr == "learner.lr=1e-5" else [1, 1, 0, 1]
        keys = [f"q{i}" for i in range(4)]
        change = {"diff": 0.0, "low": -1, "high": 1}
        return {"seed": seed, "seconds": 1.0, "em_before": 0.5, "em_after": sum(after) / 4,
                "em_before_by_source": {"1hop": 0.5}, "em_after_by_source": {"1hop": 0.5},
                "em_change": change, "em_change_by_source": {"1hop": change},
                "correct_before": dict(zip(keys, [1, 0, 0, 1], strict=True)),
                "correct_after": dict(zip(keys, after, strict=True)),
                "source": dict.fromkeys(keys, "1hop"), "reward": [0.1],
                "groups_all_wrong": [0.5], "groups_zero_advantage": [0.5],
                "estimator_counters": {}, "warm_start_sha256": digest[seed],
                **({"estimator": composition} if composition else {})}  # fmt: skip

    digest = {0: "a" * 64, 1: "b" * 64, 2: "c" * 64}
    monkeypatch.setattr(learning, "run_one", fake_run)
    monkeypatch.setattr(learning, "plot_curves", lambda report, path: path.write_text("png"))
    first = tmp_path / "first"
    argv = ["--methods", "tspo", "--seeds", "0,1", "--set", "learner.lr=1e-5",
            "--runs-dir", str(first), "--out", str(tmp_path / "a.json")]  # fmt: skip
    assert learning.main(argv) == 0
    record = (first / "runs.jsonl").read_text()
    (first / "runs.jsonl").write_text(record + '{"method": "tspo", "se')  # cut off
    argv = ["--methods", "tspo", "--seeds", "0,1,2", "--set", "learner.lr=3e-5",
            "--runs-dir", str(tmp_path / "second"), "--out", str(tmp_path / "b.json"),
            "--against", str(first / "runs.jsonl")]  # fmt: skip
    assert learning.main(argv) == 0
    assert (first / "runs.jsonl").read_text() == record + '{"method": "tspo", "se'  # untouched
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["against"]["settings"] == ["learner.lr=1e-5"]
    versus = report["methods"]["tspo"]["vs_against"]["all"]
    # seeds 0 and 1 only (seed 2 is not in the other study): 8 pairs, 2 better, 0 worse
    assert (versus["n"], versus["better"], versus["worse"]) == (8, 2, 0)
    assert versus["diff"] == pytest.approx(0.25)
    assert report["against"]["warm_start"] == {"same": [0, 1], "other": [], "unknown": []}
    out = capsys.readouterr().out
    assert "after with learner.lr=1e-5" in out and "from the same warm-start on seeds 0, 1" in out
    with pytest.raises(SystemExit):
        learning.main([*argv[:-1], str(tmp_path / "nowhere.jsonl")])
    assert "no such study record" in capsys.readouterr().err
    # --against-method: another method here (GRPO) against that record's TSPO runs
    argv = ["--methods", "grpo", "--seeds", "0,1", "--set", "learner.lr=3e-5",
            "--runs-dir", str(tmp_path / "third"), "--out", str(tmp_path / "c.json"),
            "--against", str(first / "runs.jsonl"), "--against-method", "tspo"]  # fmt: skip
    assert learning.main(argv) == 0
    report = json.loads((tmp_path / "c.json").read_text())
    assert report["against"]["method"] == "tspo"
    versus = report["methods"]["grpo"]["vs_against"]["all"]
    assert (versus["n"], versus["better"], versus["worse"]) == (8, 2, 0)
    assert "(its tspo runs and seeds with learner.lr=1e-5" in capsys.readouterr().out
    # a setting measured from another warm-start on a seed says so; a method against
    # another method's runs from another warm-start is refused
    digest[1] = "d" * 64
    setting = ["--methods", "tspo", "--seeds", "0,1", "--set", "learner.lr=3e-5",
               "--runs-dir", str(tmp_path / "fourth"), "--out", str(tmp_path / "d.json"),
               "--against", str(first / "runs.jsonl")]  # fmt: skip
    assert learning.main(setting) == 0
    report = json.loads((tmp_path / "d.json").read_text())
    assert report["against"]["warm_start"] == {"same": [0], "other": [1], "unknown": []}
    assert "from other warm-starts (the difference includes theirs) on seed 1" in (
        capsys.readouterr().out
    )
    fifth = [*argv[:7], str(tmp_path / "fifth"), *argv[8:]]
    with pytest.raises(SystemExit):
        learning.main(fifth)
    assert "grpo here and its tspo runs there started from other warm-starts on seed(s) 1" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        learning.main([*argv[:-1], "grpo"])  # the record holds no GRPO runs
    assert "holds no grpo runs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        learning.main([*argv[:-4], "--against-method", "tspo"])
    assert "--against-method needs --against" in capsys.readouterr().err


def test_a_seed_started_elsewhere_once_is_another_start_whatever_runs_recorded_none():
    """warm_starts: per seed over every run on both sides, whatever their order; one known
    difference makes the seed another start, even beside a run that recorded none."""
    sys.path.insert(0, str(ROOT / "bench"))
    from learning import warm_starts

    def runs(*digests):
        return [{"seed": seed, "warm_start_sha256": d} for seed, d in digests]

    a, b = "a" * 64, "b" * 64
    here = runs((0, a), (0, None), (1, a), (1, a), (2, None), (3, a))
    there = runs((0, b), (1, a), (2, a), (4, a))
    assert warm_starts(here, there) == {0: "other", 1: "same", 2: "unknown"}
    assert warm_starts(here[::-1], there[::-1]) == warm_starts(here, there)
    assert warm_starts(runs((0, a), (0, b)), runs((0, a))) == {0: "other"}  # not one start here


def test_the_shares_per_step_are_averaged_over_seeds_in_the_table_and_the_plot(tmp_path):
    """The all-wrong and zero-advantage shares step by step: the mean over the seeds that
    have the step (a seed with a missing value does not count as zero), in a table of the
    report and in the plot."""
    sys.path.insert(0, str(ROOT / "bench"))
    import learning

    nan = float("nan")
    change = {"diff": 0.1, "low": 0.0, "high": 0.2, "n": 2, "better": 1, "worse": 0}

    def run(seed, wrong, zero):
        return {"seed": seed, "seconds": 1.0, "em_before": 0.5, "em_after": 0.6,
                "em_before_by_source": {"3hop": 0.5}, "em_after_by_source": {"3hop": 0.6},
                "em_change": change, "em_change_by_source": {"3hop": change},
                "searches_before": 1.0, "searches_after": 1.0, "reward": [0.1] * len(wrong),
                "groups_all_wrong": wrong, "groups_zero_advantage": zero,
                "estimator_counters": {}}  # fmt: skip

    runs = [run(0, [0.5, 0.25, 0.75], [1.0, 0.5, nan]), run(1, [0.25, 0.75], [0.5, 1.0])]
    assert learning.per_step_mean(runs, "groups_all_wrong") == [0.375, 0.5, 0.75]
    assert learning.per_step_mean(runs, "groups_zero_advantage") == [0.75, 0.75, None]
    report = {"runs": {"grpo": runs}, "methods": {"grpo": learning.aggregate(runs)},
              "baseline": "grpo"}  # fmt: skip
    text = learning.table(report)
    assert "| method | step 1 | step 2 | step 3 |" in text
    assert "| grpo | 0.38 / 0.75 | 0.50 / 0.75 | 0.75 / n/a |" in text
    learning.plot_curves(report, tmp_path / "study.png")
    assert (tmp_path / "study.png").stat().st_size > 10_000


def test_the_plot_shows_each_method_against_the_baseline_seed_by_seed(tmp_path):
    """The panel against GRPO: every seed's EM after training minus GRPO's on the same seed
    (dots), and the pooled paired change with its interval (the error bar), per part; GRPO
    itself is not drawn against itself."""
    sys.path.insert(0, str(ROOT / "bench"))
    import matplotlib

    matplotlib.use("Agg")
    import learning
    import matplotlib.pyplot as plt

    def run(seed, before, after):
        keys = [f"q{i}" for i in range(len(before))]
        source = {k: ("1hop", "2hop")[i % 2] for i, k in enumerate(keys)}
        by_source = {s: sum(a for k, a in zip(keys, after, strict=True) if source[k] == s) / 2
                     for s in ("1hop", "2hop")}  # fmt: skip
        return {"seed": seed, "correct_before": dict(zip(keys, before, strict=True)),
                "correct_after": dict(zip(keys, after, strict=True)), "source": source,
                "em_after": sum(after) / len(after), "em_after_by_source": by_source}  # fmt: skip

    tspo = [run(0, [0, 0, 1, 1], [1, 1, 1, 0]), run(1, [0, 1, 0, 1], [1, 1, 1, 1])]
    grpo = [run(0, [0, 0, 1, 1], [0, 1, 1, 1]), run(1, [0, 1, 0, 1], [0, 1, 0, 1])]
    versus = {p: learning.pooled(tspo, grpo, source=None if p == "all" else p)
              for p in ("all", "1hop", "2hop")}  # fmt: skip
    report = {"runs": {"grpo": grpo, "tspo": tspo}, "baseline": "grpo",
              "methods": {"grpo": {}, "tspo": {"vs_baseline": versus}}}  # fmt: skip
    fig, axis = plt.subplots()
    learning._change_panel(axis, report, ["all", "1hop", "2hop"], baseline="grpo")
    dots = [sorted(c.get_offsets()[:, 1].tolist()) for c in axis.collections
            if c.get_offsets().shape[0] == 2]  # fmt: skip
    # seed 0: 0.75 - 0.75; seed 1: 1.0 - 0.5. 1-hop (q0, q2): 1 - 0.5 and 1 - 0; 2-hop:
    # (q1, q3) 0.5 - 1 and 1 - 1
    assert dots == [[0.0, 0.5], [0.5, 1.0], [-0.5, 0.0]]
    centres = [line.get_ydata()[0] for line in axis.lines if line.get_marker() == "o"]
    assert centres == pytest.approx([versus[p]["diff"] for p in ("all", "1hop", "2hop")])
    assert [t.get_text() for t in axis.get_xticklabels()] == ["tspo"]
    plt.close(fig)


def test_a_seed_made_again_from_another_start_is_paired_with_the_baselines_run_from_it(
    tmp_path, capsys
):
    """--report over two records: the study's, and one holding a seed's methods made again
    from another machine's warm-start of that seed. Each of those runs is compared with
    GRPO's run from its own start, the rest with GRPO's from the study's; GRPO's two runs
    of the seed are set against each other (what the start alone moved). A method's seed
    recorded twice, or a run from another start without GRPO's run from it, is refused."""
    sys.path.insert(0, str(ROOT / "bench"))
    import matplotlib

    matplotlib.use("Agg")
    import learning
    import matplotlib.pyplot as plt

    keys = [f"q{i}" for i in range(4)]
    source = dict(zip(keys, ["1hop", "2hop", "1hop", "2hop"], strict=True))

    def line(method, seed, digest, before, after):
        change = {"diff": (sum(after) - sum(before)) / 4, "low": -1.0, "high": 1.0}
        by_source = {s: sum(a for k, a in zip(keys, after, strict=True) if source[k] == s) / 2
                     for s in ("1hop", "2hop")}  # fmt: skip
        return json.dumps({
            "method": method, "settings": [], "defaults": "x", "seed": seed, "seconds": 1.0,
            "em_before": sum(before) / 4, "em_after": sum(after) / 4,
            "em_before_by_source": {"1hop": 0.5, "2hop": 0.5}, "em_after_by_source": by_source,
            "em_change": change, "em_change_by_source": {"1hop": change, "2hop": change},
            "searches_before": 1.0, "searches_after": 1.0, "reward": [0.1, 0.2],
            "groups_all_wrong": [0.5, 0.5], "groups_zero_advantage": [0.5, 0.5],
            "estimator_counters": {}, "warm_start_sha256": digest * 64, "source": source,
            "correct_before": dict(zip(keys, before, strict=True)),
            "correct_after": dict(zip(keys, after, strict=True)),
        }) + "\n"  # fmt: skip

    start = [0, 1, 0, 1]
    study = tmp_path / "runs.jsonl"
    study.write_text(
        line("grpo", 0, "a", start, [0, 1, 1, 1]) + line("cw_grpo", 0, "a", start, [1, 1, 1, 1])
        + line("grpo", 1, "b", start, [0, 0, 0, 1])  # seed 1: cw_grpo to come, from elsewhere
    )  # fmt: skip
    again = tmp_path / "runs_seed1_elsewhere.jsonl"  # seed 1 made again: other weights
    again.write_text(line("grpo", 1, "c", start, [1, 1, 0, 1])
                     + line("cw_grpo", 1, "c", start, [1, 1, 1, 1]))  # fmt: skip
    out = tmp_path / "report.json"
    argv = ["--methods", "grpo,cw_grpo", "--seeds", "0,1", "--out", str(out),
            "--report", str(study), "--report", str(again)]  # fmt: skip
    assert learning.main(argv) == 0
    report = json.loads(out.read_text())
    # grpo's row is the study's runs; cw_grpo's seed 1 comes from the second record
    assert [r["warm_start_sha256"][0] for r in report["runs"]["grpo"]] == ["a", "b"]
    assert [r["warm_start_sha256"][0] for r in report["runs"]["cw_grpo"]] == ["a", "c"]
    # against GRPO: seed 0 one question better (4 right against 3), seed 1 against GRPO's
    # run from "c" (3 right), not the study's from "b" (1 right): +1/4 on each seed
    versus = report["methods"]["cw_grpo"]["vs_baseline"]["all"]
    assert (versus["seeds"], versus["better"], versus["worse"]) == (2, 2, 0)
    assert versus["diff"] == pytest.approx(0.25)
    (alt,) = report["other_starts"]
    assert alt["seed"] == 1 and alt["paired_with"] == ["cw_grpo"]
    moved = alt["vs_study_start"]["all"]  # grpo from "c" minus grpo from "b": q0, q1 better
    assert (moved["better"], moved["worse"], moved["diff"]) == (2, 0, 0.5)
    text = capsys.readouterr().out
    assert "Seeds with runs from another warm-start" in text
    assert f"| 1 | {'c' * 12}... (the study's: {'b' * 12}...) | cw_grpo | 0.500 / 0.750" in text
    # the plot's panel against GRPO draws seed 1 against GRPO's run from "c" too
    fig, axis = plt.subplots()
    learning._change_panel(axis, report, ["all"], baseline="grpo")
    (dots,) = [c.get_offsets()[:, 1].tolist() for c in axis.collections
               if c.get_offsets().shape[0] == 2]  # fmt: skip
    assert dots == [0.25, 0.25]
    plt.close(fig)
    # cw_grpo's seed 1 in both records: refused
    (tmp_path / "twice.jsonl").write_text(line("cw_grpo", 0, "a", start, [0, 0, 0, 0]))
    with pytest.raises(SystemExit):
        learning.main([*argv, "--report", str(tmp_path / "twice.jsonl")])
    assert "records cw_grpo seed 0, as" in capsys.readouterr().err
    # a run from another start without GRPO's run from it: refused, naming what it needs
    (tmp_path / "alone.jsonl").write_text(line("cw_grpo", 1, "c", start, [1, 1, 1, 1]))
    with pytest.raises(SystemExit):
        learning.main([*argv[:-2], "--report", str(tmp_path / "alone.jsonl")])
    err = capsys.readouterr().err
    assert "cw_grpo seed 1 did not start where the seed's grpo run did" in err
    assert "needs grpo's run from it" in err
