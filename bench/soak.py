"""A long run of the asynchronous loop: does anything grow with the step count?

    python bench/soak.py                          # 100 steps, tiny-random
    python bench/soak.py --steps 300 --out /tmp/soak.json

Runs :class:`~ray_credit.pipeline.Pipeline` for ``--steps`` steps on tiny-random (two
generators on the transformers sampler, one learner, GRPO), and after every step samples
the driver's resident memory, the object store's bytes in use, and the run's own Ray actors
alive and placement groups not removed (those created after it started). Reports the first and the last ten steps' means of each
and their change, then shuts the run down and counts what is left alive. JSON to
``--out``; ``tests/ray/test_soak.py`` runs it in CI and checks nothing leaks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def known_ids() -> tuple[set[str], set[str]]:
    """The ids of every actor and placement group the cluster knows, in any state."""
    from ray._private.state import actors
    from ray.util import placement_group_table

    return set(actors()), set(placement_group_table())


def cluster_state(before: tuple[set[str], set[str]]) -> dict[str, float]:
    """Driver RSS, object store bytes in use, and the actors alive and placement groups not
    removed among those created after ``before`` was taken: this run's own (on a shared
    cluster an earlier job's actors may still be dying or restarting)."""
    import psutil
    import ray
    from ray._private.state import actors
    from ray.util import placement_group_table

    total = ray.cluster_resources().get("object_store_memory", 0.0)
    free = ray.available_resources().get("object_store_memory", total)
    return {
        "driver_rss_mb": psutil.Process().memory_info().rss / 2**20,
        "object_store_mb": (total - free) / 2**20,
        "actors_alive": float(
            sum(a["State"] == "ALIVE" for i, a in actors().items() if i not in before[0])
        ),
        "placement_groups": float(
            sum(
                g["state"] != "REMOVED"
                for i, g in placement_group_table().items()
                if i not in before[1]
            )
        ),
    }


def soak(steps: int, *, window: int = 10) -> dict:
    """Run ``steps`` steps on the connected cluster; the samples and the summary."""
    import ray

    from ray_credit.actors.generator import GeneratorConfig, make_generator_actor
    from ray_credit.actors.learner import LearnerConfig
    from ray_credit.actors.learner_group import LearnerGroup
    from ray_credit.actors.retriever import make_retriever_actor
    from ray_credit.data import WorldConfig, make_world
    from ray_credit.pipeline import Pipeline, PipelineConfig, estimator_stage

    if steps < 2 * window:
        raise ValueError(f"--steps must be at least {2 * window} to compare two windows")
    before = known_ids()
    baseline = cluster_state(before)
    world = make_world(WorldConfig(seed=3, num_entities=20))
    gen = GeneratorConfig(group_size=2, max_turns=2, max_new_tokens=6, response_prefix="<search>")
    retriever = make_retriever_actor(world.corpus, num_cpus=0.25)
    generators = [
        make_generator_actor("tiny-random", retriever, gen, num_cpus=0.25) for _ in range(2)
    ]
    learner = LearnerGroup("tiny-random", LearnerConfig(lr=1e-3))
    # steady state only: on a busy cluster an actor may wait for CPUs an earlier job's
    # actors still hold (the retriever, unused while tiny-random never closes a search)
    ray.get([a.__ray_ready__.remote() for a in [retriever, *generators]], timeout=300)
    samples: list[dict[str, float]] = []

    def sample(metrics: dict[str, float]) -> None:
        samples.append({"step": metrics["pipeline/step"], **cluster_state(before)})

    config = PipelineConfig(steps=steps, groups_per_step=2, chunk_groups=1, max_staleness=1)
    pipeline = Pipeline(
        generators, learner, world.questions, [estimator_stage("grpo")], config, on_step=sample
    )
    started = time.perf_counter()
    pipeline.run()
    seconds = time.perf_counter() - started
    learner.shutdown()
    for actor in [*generators, retriever]:
        ray.kill(actor)
    del pipeline, generators, retriever, learner
    deadline = time.monotonic() + 30  # kills are asynchronous
    while time.monotonic() < deadline:
        after = cluster_state(before)
        if after["actors_alive"] == 0 and after["placement_groups"] == 0:
            break
        time.sleep(0.5)
    keys = ["driver_rss_mb", "object_store_mb", "actors_alive", "placement_groups"]
    first, last = samples[:window], samples[-window:]
    summary = {
        key: {
            "first": mean(s[key] for s in first),
            "last": mean(s[key] for s in last),
            "change": mean(s[key] for s in last) - mean(s[key] for s in first),
        }
        for key in keys
    }
    return {
        "steps": steps,
        "window": window,
        "seconds": seconds,
        "baseline": baseline,
        "summary": summary,
        "after_shutdown": after,
        "samples": samples,
    }


def table(report: dict) -> str:
    w = report["window"]
    lines = [f"| | first {w} steps | last {w} steps | change |", "|---|---:|---:|---:|"]
    for key, s in report["summary"].items():
        lines.append(f"| {key} | {s['first']:.1f} | {s['last']:.1f} | {s['change']:+.1f} |")
    after = report["after_shutdown"]
    lines.append(
        f"\nthe run's actors and placement groups alive after shutdown: "
        f"{after['actors_alive']:.0f} and {after['placement_groups']:.0f}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    import ray

    if os.environ.get("RAY_ADDRESS"):
        ray.init()  # the cluster there
    else:
        ray.init(address="local", num_cpus=4, include_dashboard=False)
    report = soak(args.steps)
    print(table(report))
    print(f"{args.steps} steps in {report['seconds']:.0f} s")
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
