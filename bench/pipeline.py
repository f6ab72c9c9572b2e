"""The pipeline against its targets: async vs sync with equal generation and training
costs, a signal stage hidden behind training, and the driver's memory as batches grow.

    python bench/pipeline.py                      # 1 s to generate a step, 1 s to train one
    python bench/pipeline.py --cost 2 --steps 16 --check

Runs the real :class:`~ray_credit.pipeline.Pipeline` in one process, on one local Ray
cluster, with the same data each time. Only the costs are made up, so that they are
exactly what they say:

- the generator actor builds batches of the real size (``--groups-per-step`` groups of
  ``--group-size`` trajectories per step, 1-4 turns, token columns), tags their turns with
  its policy version, and sleeps until ``--cost`` seconds per step have passed (each chunk
  its share);
- the learner actor receives the step's chunks through the object store, concatenates and
  pads them to tensors (``to_torch``) and sleeps until ``--cost`` seconds have passed; then
  ``--weights-mb`` of weights are published to the generator;
- the stage (modes "+ stage") is an actor that sleeps ``--stage-cost`` seconds per step,
  each chunk its share, like a judge pool or an info-gain scorer.

Everything else is the library: admission control, the stage task of every chunk, the
GRPO estimator, the staleness check, metrics and weight publication. Modes: synchronous
(``max_staleness=0``) and asynchronous (``max_staleness=1``), each without and with the
stage. From the steady-state steps (the first waits for the first generation):

- ``speedup``: sync / async seconds per step, no stage (2.0 is the limit; the target
  is >= 1.7);
- ``overhead``: the async step's seconds beyond the cost, as a share of the step (target
  <= 5 %), no stage;
- ``async + stage`` step seconds (target <= 1.10 s at cost 1 s and a 0.5 s stage:
  the stage overlaps training, only the last chunk's share is left on the critical path,
  so the step is about ``cost + stage_cost / chunks / 2``);
- the driver's peak RSS, in a fresh process per size, for batches of 1x and 10x the tokens.

Writes JSON to ``bench/results/pipeline.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import ray  # noqa: E402

from ray_credit.batch import TrajectoryBatch  # noqa: E402
from ray_credit.pipeline import Pipeline, PipelineConfig, actor_stage, estimator_stage  # noqa: E402
from ray_credit.pipeline.report import generation_summary  # noqa: E402
from ray_credit.testing import random_batch  # noqa: E402


@ray.remote(num_cpus=1)
class FixedCostGenerator:
    """Real-size batches at a fixed cost per group."""

    def __init__(self, seconds_per_group: float, group_size: int, tokens_scale: int):
        self.seconds_per_group = seconds_per_group
        self.group_size = group_size
        self.scale = tokens_scale
        self.policy_version = 0
        self.calls = 0

    def generate_chunk(self, questions, *, progress=None, call=None):  # neither is used here
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
            prompt_tokens=256 * self.scale,
            tokens_per_turn=128 * self.scale,
        )
        left = self.seconds_per_group * len(questions) - (time.perf_counter() - started)
        time.sleep(max(0.0, left))
        return batch, generation_summary(batch)

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

    def train(self, *chunks):
        started = time.perf_counter()
        tensors = TrajectoryBatch.concat(chunks).to_torch()
        left = self.seconds - (time.perf_counter() - started)
        time.sleep(max(0.0, left))
        self.version += 1
        return {"learner/tokens": float(tensors["attention_mask"].sum())}

    def weights(self):
        return {"w": self.weights_array}


class _Call:
    def __init__(self, ref):
        self.refs = [ref]

    def result(self, timeout=None):
        return ray.get(self.refs[0], timeout=timeout)


class FixedCostLearner:
    """The learner interface the pipeline drives (as ``LearnerGroup`` offers it)."""

    def __init__(self, seconds: float, weights_mb: float):
        self.actor = FixedCostLearnerActor.remote(seconds, weights_mb)
        self.policy_version = 0

    def submit_train(self, refs):
        self.policy_version += 1
        return _Call(self.actor.train.remote(*refs))

    def weights(self):
        return self.actor.weights.remote()


@ray.remote(num_cpus=0)
class FixedCostStage:
    """A signal stage with a made-up cost per group (a judge pool, a scorer)."""

    def __init__(self, seconds_per_group: float):
        self.seconds_per_group = seconds_per_group

    def run(self, batch):
        time.sleep(self.seconds_per_group * batch.num_groups)
        return batch.with_metrics({"bench/stage_calls": 1.0})


def run_mode(args, max_staleness: int, stage_cost: float, tokens_scale: int = 1) -> dict:
    questions = [{"question": f"q{i}?", "golden_answers": ["a"]} for i in range(256)]
    generator = FixedCostGenerator.remote(
        args.cost / args.groups_per_step, args.group_size, tokens_scale
    )
    learner = FixedCostLearner(args.cost, args.weights_mb)
    stages = [estimator_stage("grpo")]
    stage = None
    if stage_cost:
        stage = FixedCostStage.remote(stage_cost / args.groups_per_step)
        stages.insert(0, actor_stage(stage.run, name="signal"))
    ray.get([generator.get_policy_version.remote(), learner.actor.weights.remote()])
    pipeline = Pipeline(
        [generator],
        learner,
        questions,
        stages,
        PipelineConfig(
            steps=args.steps,
            groups_per_step=args.groups_per_step,
            chunk_groups=args.chunk_groups,
            max_staleness=max_staleness,
        ),
    )
    started = time.perf_counter()
    history = pipeline.run()
    total = time.perf_counter() - started
    steady = history[1:]
    step_s = [m["time/step_s"] for m in steady]
    for actor in (generator, learner.actor, stage):
        if actor is not None:
            ray.kill(actor)
    return {
        "max_staleness": max_staleness,
        "stage_cost": stage_cost,
        "total_s": total,
        "step_s_mean": statistics.mean(step_s),
        "step_s_median": statistics.median(step_s),
        "train_s_mean": statistics.mean(m["time/train_s"] for m in steady),
        "wait_generation_s_mean": statistics.mean(m["time/wait_generation_s"] for m in steady),
        "wait_stages_s_mean": statistics.mean(m["time/wait_stages_s"] for m in steady),
        "stages_s_mean": statistics.mean(m["time/stages_s"] for m in steady),
        "stages_hidden_s_mean": statistics.mean(m["time/stages_hidden_s"] for m in steady),
        "staleness_mean": statistics.mean(m["staleness/mean"] for m in history),
        "staleness_max": max(m["staleness/max"] for m in history),
        "tokens_per_step": history[0]["train/tokens"],
        "wait_publication_s_total": sum(m["time/wait_publication_s"] for m in history),
    }


def driver_rss(args, scale: int) -> dict:
    """One async run in a fresh process; its peak RSS (the driver's only)."""
    out = subprocess.run(
        [
            sys.executable, __file__, "--rss-probe", str(scale), "--cost", str(args.cost),
            "--steps", str(args.steps), "--groups-per-step", str(args.groups_per_step),
            "--group-size", str(args.group_size), "--weights-mb", str(args.weights_mb),
            "--chunk-groups", str(args.chunk_groups),
        ],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def rss_probe(args) -> None:
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        result = run_mode(args, 1, 0.0, tokens_scale=args.rss_probe)
    finally:
        ray.shutdown()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(json.dumps({"scale": args.rss_probe, "tokens_per_step": result["tokens_per_step"],
                      "driver_peak_rss_mb": peak_mb}))  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cost", type=float, default=1.0, help="seconds per step, each side")
    parser.add_argument("--stage-cost", type=float, default=0.5, help="stage seconds per step")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--groups-per-step", type=int, default=8)
    parser.add_argument("--chunk-groups", type=int, default=2, help="groups per chunk")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--weights-mb", type=float, default=64.0)
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "pipeline.json"))
    parser.add_argument("--rss-probe", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be >= 3 (the first step is warm-up)")
    if args.rss_probe:
        rss_probe(args)
        return 0

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        modes = {
            "sync": run_mode(args, 0, 0.0),
            "async": run_mode(args, 1, 0.0),
            "sync + stage": run_mode(args, 0, args.stage_cost),
            "async + stage": run_mode(args, 1, args.stage_cost),
        }
    finally:
        ray.shutdown()
    rss = [driver_rss(args, 1), driver_rss(args, 10)]

    sync, asynchronous, staged = modes["sync"], modes["async"], modes["async + stage"]
    speedup = sync["step_s_mean"] / asynchronous["step_s_mean"]
    overhead = (asynchronous["step_s_mean"] - args.cost) / asynchronous["step_s_mean"]
    result = {
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "args": vars(args),
        "modes": modes,
        "speedup": speedup,
        "speedup_total": sync["total_s"] / asynchronous["total_s"],
        "overhead": overhead,
        "async_stage_step_s": staged["step_s_mean"],
        "driver_rss": rss,
        "targets": {"speedup": 1.7, "overhead": 0.05, "async_stage_step_s": 1.1 * args.cost},
    }
    chunks = args.groups_per_step // args.chunk_groups
    print(
        f"cost {args.cost:.2f} s per step each side, stage {args.stage_cost:.2f} s per step, "
        f"{args.steps} steps of {args.groups_per_step} x {args.group_size} trajectories in "
        f"{chunks} chunks ({sync['tokens_per_step']:.0f} tokens), weights {args.weights_mb:.0f} MB"
    )
    for name, r in modes.items():
        print(
            f"{name:<14} {r['step_s_mean']:.3f} s/step (median {r['step_s_median']:.3f}), "
            f"train {r['train_s_mean']:.3f}, wait generation {r['wait_generation_s_mean']:.3f}, "
            f"wait stages {r['wait_stages_s_mean']:.3f}, stages {r['stages_s_mean']:.3f} "
            f"({r['stages_hidden_s_mean']:.3f} hidden), staleness mean {r['staleness_mean']:.2f} "
            f"max {r['staleness_max']:.0f}"
        )
    print(
        f"speedup {speedup:.2f}x (whole runs {result['speedup_total']:.2f}x; target >= 1.7x), "
        f"overhead {overhead:.1%} of the async step (target <= 5%), async + stage "
        f"{staged['step_s_mean']:.3f} s/step (target <= {1.1 * args.cost:.2f})"
    )
    for r in rss:
        print(
            f"driver peak RSS {r['driver_peak_rss_mb']:.0f} MB with {r['tokens_per_step']:.0f} "
            f"tokens per step (x{r['scale']})"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    missed = (
        speedup < 1.7
        or overhead > 0.05
        or staged["step_s_mean"] > 1.1 * args.cost
        or rss[1]["driver_peak_rss_mb"] > 1.1 * rss[0]["driver_peak_rss_mb"]
    )
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
