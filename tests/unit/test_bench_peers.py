"""bench/peers.py: ray_credit and TRL on the same job, the seconds of each step split into
their parts, the start-up apart, and the ratio on the last line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import peers  # noqa: E402


def _step(**kw):
    return {"seconds": 10.0, "generation_s": 4.0, "retrieval_s": 1.0, "update_s": 5.0,
            "trajectories": 8, "trained_tokens": 100, "reward": 0.5, **kw}  # fmt: skip


def test_a_synchronous_steps_seconds_split_into_generation_retrieval_update_and_the_rest():
    parts = peers.breakdown({"steps": [_step(), _step(seconds=12.0)]})["parts"]
    assert parts["generation (without retrieval)"]["seconds"] == 6.0
    assert parts["retrieval"]["seconds"] == 2.0
    assert parts["update"]["seconds"] == 10.0
    assert parts["other"]["seconds"] == pytest.approx(22.0 - 18.0)
    assert sum(p["share"] for p in parts.values()) == pytest.approx(1.0)


def test_rates_weigh_the_update_against_the_cpus_matmul_rate():
    steps = [_step(tokens=1000.0), _step(tokens=3000.0)]
    r = peers.rates({"steps": steps}, params=1_000_000, matmul={"bfloat16": 100.0})
    assert r["generated_tokens_per_s"] == pytest.approx(200 / 6.0)
    assert r["update_gflops"] == pytest.approx(6 * 1e6 * 4000 / 10.0 / 1e9)
    assert r["update_share_of_bf16_matmul"] == pytest.approx(r["update_gflops"] / 100.0)


def test_an_overlapped_step_counts_only_the_wait_for_generation_on_the_clock():
    step = _step(seconds=10.0, generation_s=9.0, update_s=6.0, wait_generation_s=2.0,
                 weight_sync_s=0.5, checkpoint_s=1.0)  # fmt: skip
    result = peers.breakdown({"steps": [step]})
    parts, beside = result["parts"], result["beside"]
    assert result["overlapped"]
    # 9 s of generation ran beside the update: the clock saw 6 + 0.5 + 1 + 2, and 0.5 more
    assert parts["other"]["seconds"] == pytest.approx(0.5)
    assert parts["waiting for generation"]["seconds"] == 2.0
    assert sum(p["share"] for p in parts.values()) == pytest.approx(1.0)
    assert beside["generation (without retrieval)"]["seconds"] == 8.0
    assert "retrieval" not in parts


def test_speed_is_over_all_steps_and_the_later_steps_mean_leaves_the_first_out():
    s = peers.speed({"steps": [_step(seconds=30.0), _step(seconds=10.0), _step(seconds=20.0)]})
    assert s["step_s_mean"] == 20.0 and s["step_s_mean_after_first"] == 15.0
    assert s["trajectories_per_s"] == pytest.approx(24 / 60)
    assert s["trained_tokens_per_s"] == pytest.approx(300 / 60)
    assert s["rewards"] == [0.5, 0.5, 0.5]


def test_start_up_is_what_came_before_step_1_less_the_evaluation_before_training():
    marks = [
        (400.0, "eval before training: EM 0.667 on 120 held-out questions (policy version 0, 75s)"),
        (700.0, "step 1/4  reward 0.7  step 200s  [11.7 min]"),
    ]  # fmt: skip
    assert peers._startup(marks, 200.0) == 700.0 - 200.0 - 75.0


def test_evaluation_takes_the_data_flags_of_the_task_only():
    task = ["--pipeline.groups_per_step", "2", "--data.eval_questions", "8",
            "--generator.group_size", "2"]  # fmt: skip
    assert peers._eval_flags(task) == ["--data.eval_questions", "8"]


@pytest.mark.e2e  # both systems train, then two evaluations: the second test command
@pytest.mark.bench
def test_peers_runs_both_systems_from_one_command_and_prints_the_ratio(tmp_path):
    pytest.importorskip("trl")
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "peers.py"), "--steps", "1", "--questions", "2",
         "--group-size", "2", "--micro-batch", "2", "--eval-questions", "8",
         "--warm_start.questions", "8", "--warm_start.epochs", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, timeout=3000,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "peers.json").read_text())
    for name in ("ray_credit", "trl"):
        system = result[name]
        assert len(system["steps"]) == 1 and system["steps"][0]["trajectories"] == 4
        assert system["speed"]["trajectories_per_s"] > 0 and system["startup_s"] > 0
        assert system["memory"]["peak_pss_gb"] > 0
        assert 0 <= system["eval"]["after"]["em"] <= 1
    assert result["trl"]["eval"]["after"]["change"]["all"]["n"] == 8
    assert out.stdout.strip().splitlines()[-1].startswith("ratio: ray_credit ")


class _CharTokenizer:
    eos_token_id, pad_token_id = 0, 0

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if i)


def test_a_turn_ends_at_its_stop_string_and_the_padding_after_it_is_not_sampled():
    import math

    import peers_trl

    sampler = peers_trl.GenerateSampler.__new__(peers_trl.GenerateSampler)
    sampler.tokenizer, sampler.eos_token_id = _CharTokenizer(), 0
    stop = ("</a>",)
    row = [ord(c) for c in "x</a>"] + [0, 0]
    logps = [-1.0] * 5 + [-math.inf, -math.inf]
    assert sampler._turn_length(row, logps, stop) == (5, True)
    # an eos the policy sampled is part of the turn; a turn that met neither hit its limit
    assert sampler._turn_length([120, 0, 0], [-1.0, -0.5, -math.inf], stop) == (2, True)
    assert sampler._turn_length([120, 121], [-1.0, -1.0], stop) == (2, False)
