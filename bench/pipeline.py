"""Asynchronous against synchronous training, with generation and training costs equal.

    python bench/pipeline.py                      # 1 s to generate a step, 1 s to train one
    python bench/pipeline.py --cost 2 --steps 16 --check

Runs the real :class:`~ray_credit.pipeline.Pipeline` twice in one process, on one local
Ray cluster, with the same data: ``max_staleness=0`` (synchronous: the generator waits
for every update) and ``max_staleness=1`` (the generator works on step k+1 while the
learner trains step k). Only the two costs are made up, so that they are exactly equal:

- the generator actor builds a batch of the real size (``--groups-per-step`` groups of
  ``--group-size`` trajectories, 1-4 turns, token columns), tags its turns with its
  policy version, and sleeps until ``--cost`` seconds per step have passed;
- the learner actor receives the batch through the object store, pads it to tensors
  (``to_torch``) and sleeps until ``--cost`` seconds have passed, then publishes
  ``--weights-mb`` of weights, which the pipeline ships to the generator.

Everything else is the library: admission control, the object store, the GRPO estimator
stage, staleness checks, metrics and weight publication. Reported, from steady-state
steps (the first step of each run waits for the first generation in both modes):

- ``speedup``: synchronous seconds per step / asynchronous seconds per step (2.0 is the
  limit with equal costs; DESIGN.md section 8 asks >= 1.7);
- ``overhead``: the asynchronous step's seconds beyond the cost, as a share of the step
  (``(step - cost) / step``; the target is <= 5 %): everything the loop adds (waits,
  transfers, the estimator, publication, Ray calls);
- the loop's own share: step seconds outside the learner call and the generation wait.

Writes JSON to ``bench/results/pipeline.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import ray  # noqa: E402

from ray_credit.pipeline import Pipeline, PipelineConfig, estimator_stage  # noqa: E402
from ray_credit.testing import random_batch  # noqa: E402


@ray.remote(num_cpus=1)
class FixedCostGenerator:
    """Real-size batches at a fixed cost per group."""

    def __init__(self, seconds_per_group: float, group_size: int):
        self.seconds_per_group = seconds_per_group
        self.group_size = group_size
        self.policy_version = 0
        self.calls = 0

    def generate(self, questions):
        started = time.perf_counter()
        self.calls += 1
        batch = random_batch(
            self.calls,
            num_groups=len(questions),
            group_size=self.group_size,
            max_turns=4,
            singleton_frac=0.0,
            id_prefix=f"c{self.calls}-",
            policy_version=self.policy_version,
            prompt_tokens=256,
            tokens_per_turn=128,
        )
        left = self.seconds_per_group * len(questions) - (time.perf_counter() - started)
        time.sleep(max(0.0, left))
        return batch

    def update_weights(self, version, weights):
        if version <= self.policy_version:
            raise ValueError(f"version {version} is not newer than {self.policy_version}")
        self.policy_version = version
        return version

    def get_policy_version(self):
        return self.policy_version


@ray.remote(num_cpus=1)
class FixedCostLearnerActor:
    def __init__(self, seconds: float, weights_mb: float):
        self.seconds = seconds
        self.weights_array = np.ones(int(weights_mb * 2**20) // 4, np.float32)
        self.version = 0

    def train(self, batch):
        started = time.perf_counter()
        tensors = batch.to_torch()
        left = self.seconds - (time.perf_counter() - started)
        time.sleep(max(0.0, left))
        self.version += 1
        return {"train/tokens": float(tensors["attention_mask"].sum())}

    def weights(self):
        return {"w": self.weights_array}


class FixedCostLearner:
    """The learner interface the pipeline drives (as ``LearnerGroup`` offers it)."""

    def __init__(self, seconds: float, weights_mb: float):
        self.actor = FixedCostLearnerActor.remote(seconds, weights_mb)
        self.version = 0

    def train(self, batch):
        metrics = ray.get(self.actor.train.remote(ray.put(batch)))
        self.version += 1
        return metrics

    def weights(self):
        return self.actor.weights.remote()

    @property
    def policy_version(self):
        return self.version

    def save(self, folder):
        raise NotImplementedError("the benchmark does not checkpoint")


def run_mode(args, max_staleness: int) -> dict:
    questions = [{"question": f"q{i}?", "golden_answers": ["a"]} for i in range(256)]
    generator = FixedCostGenerator.remote(args.cost / args.groups_per_step, args.group_size)
    learner = FixedCostLearner(args.cost, args.weights_mb)
    ray.get([generator.get_policy_version.remote(), learner.actor.weights.remote()])
    pipeline = Pipeline(
        [generator],
        learner,
        questions,
        [estimator_stage("grpo")],
        PipelineConfig(
            steps=args.steps, groups_per_step=args.groups_per_step, max_staleness=max_staleness
        ),
    )
    started = time.perf_counter()
    history = pipeline.run()
    total = time.perf_counter() - started
    steady = history[1:]
    step_s = [m["time/step_s"] for m in steady]
    loop_s = [m["time/step_s"] - m["time/train_s"] - m["time/wait_generation_s"] for m in steady]
    ray.kill(generator)
    ray.kill(learner.actor)
    return {
        "max_staleness": max_staleness,
        "total_s": total,
        "step_s_mean": statistics.mean(step_s),
        "step_s_median": statistics.median(step_s),
        "train_s_mean": statistics.mean(m["time/train_s"] for m in steady),
        "wait_generation_s_mean": statistics.mean(m["time/wait_generation_s"] for m in steady),
        "loop_s_mean": statistics.mean(loop_s),
        "staleness_mean": statistics.mean(m["staleness/mean"] for m in history),
        "staleness_max": max(m["staleness/max"] for m in history),
        "tokens_per_step": history[0]["train/tokens"],
        "sync_seconds_total": history[-1]["sync/seconds"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cost", type=float, default=1.0, help="seconds per step, each side")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--groups-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--weights-mb", type=float, default=64.0)
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "pipeline.json"))
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be >= 3 (the first step is warm-up)")

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        sync = run_mode(args, 0)
        asynchronous = run_mode(args, 1)
    finally:
        ray.shutdown()

    speedup = sync["step_s_mean"] / asynchronous["step_s_mean"]
    overhead = (asynchronous["step_s_mean"] - args.cost) / asynchronous["step_s_mean"]
    loop_share = asynchronous["loop_s_mean"] / asynchronous["step_s_mean"]
    result = {
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "args": vars(args),
        "sync": sync,
        "async": asynchronous,
        "speedup": speedup,
        "speedup_total": sync["total_s"] / asynchronous["total_s"],
        "overhead": overhead,
        "loop_share": loop_share,
        "targets": {"speedup": 1.7, "overhead": 0.05},
    }
    print(
        f"cost {args.cost:.2f} s per step each side, {args.steps} steps of "
        f"{args.groups_per_step} x {args.group_size} trajectories "
        f"({sync['tokens_per_step']:.0f} tokens), weights {args.weights_mb:.0f} MB"
    )
    for name, r in (("sync  (max_staleness=0)", sync), ("async (max_staleness=1)", asynchronous)):
        print(
            f"{name}: {r['step_s_mean']:.3f} s/step (median {r['step_s_median']:.3f}), "
            f"train {r['train_s_mean']:.3f} s, generation wait {r['wait_generation_s_mean']:.3f} s, "
            f"loop {r['loop_s_mean'] * 1e3:.1f} ms, staleness mean {r['staleness_mean']:.2f} "
            f"max {r['staleness_max']:.0f}, run {r['total_s']:.1f} s"
        )
    print(
        f"speedup {speedup:.2f}x (whole runs {result['speedup_total']:.2f}x; target >= 1.7x), "
        f"overhead {overhead:.1%} of the async step (target <= 5%), "
        f"loop {loop_share:.1%}"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    if args.check and (speedup < 1.7 or overhead > 0.05):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
