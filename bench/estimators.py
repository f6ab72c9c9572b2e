"""Estimator throughput against each estimator's per-group loop reference, in one run.

    python bench/estimators.py                       # 4,096 groups x 8 trajectories x 1..8 turns
    python bench/estimators.py --groups 512 --out bench/results/estimators.json

For every registered estimator that has a loop reference in ``tests/unit/test_<module>.py``
(a ``REFERENCES`` dict: name -> ``reference(rows, config)``), the same random batch goes
through the vectorized estimator (best of ``--repeats`` calls, each on a fresh batch
wrapper so no cached index carries over) and through the reference (best of
``--reference-repeats``; its loop only: the ``to_records()`` conversion it reads is done
beforehand and not timed). Both sides take the minimum, as timeit advises: slower
repeats measure interference from the rest of the machine, not the code. The garbage
collector is paused while timing, as in timeit. Prints turns/s, the speedup ratio and the max abs difference of the two
outputs, and writes JSON. Targets: >= 30x the reference for every
estimator, >= 2 M turns/s for grpo and tspo. Each estimator's composition of parts
(``Estimator.composition``, what ``pipelines/compose.py`` runs) is timed the same way on
the same batch: its turns/s, its time over the fused estimator's, and its max abs
difference from it (no target: the cost of writing credit as parts).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ray_credit.batch import TrajectoryBatch  # noqa: E402
from ray_credit.estimators import ESTIMATORS  # noqa: E402
from ray_credit.estimators.compose import compose  # noqa: E402
from ray_credit.testing import random_batch  # noqa: E402

SPEEDUP_TARGET = 30.0
TURNS_PER_S_TARGET = {"grpo": 2e6, "tspo": 2e6}


@contextlib.contextmanager
def gc_paused():
    """Time without the cyclic garbage collector, as timeit does: its pauses are noise.

    One collection before the timed loop, none inside it: a collection walks every live
    object, which also evicts the CPU caches the next timed call would use.
    """
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def load_references() -> dict:
    references = {}
    for path in sorted((ROOT / "tests" / "unit").glob("test_*.py")):
        module = importlib.import_module(f"tests.unit.{path.stem}")
        references.update(getattr(module, "REFERENCES", {}))
    return references


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, default=4096)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--reference-repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", help="estimator names (default: all with a reference)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "estimators.json")
    args = parser.parse_args()

    references = load_references()
    names = args.only or [n for n in ESTIMATORS if n in references]
    batch = random_batch(
        args.seed,
        num_groups=args.groups,
        group_size=args.group_size,
        max_turns=args.max_turns,
        singleton_frac=0.0,
    )
    print(f"batch: {len(batch)} trajectories, {batch.num_groups} groups, {batch.num_turns} turns")
    print(
        f"{'estimator':<10} {'turns/s':>12} {'ref turns/s':>12} {'speedup':>9} {'max|diff|':>10}"
        f" {'parts turns/s':>14} {'parts/fused':>11} {'parts diff':>10}  targets"
    )

    results, ok = [], True
    for name in names:
        estimator = ESTIMATORS[name]
        config = estimator.make_config()
        estimator(batch, config)  # warm-up
        times = []
        with gc_paused():
            for _ in range(args.repeats):
                # A fresh wrapper each call: no cached group/turn index carries over.
                cold = TrajectoryBatch(batch.table, validate=False)
                start = time.perf_counter()
                out = estimator(cold, config)
                times.append(time.perf_counter() - start)
        vectorized = min(times)
        composed = compose(estimator.composition(config))
        composed(batch)  # warm-up
        parts_times = []
        with gc_paused():
            for _ in range(args.repeats):
                cold = TrajectoryBatch(batch.table, validate=False)
                start = time.perf_counter()
                parts_out = composed(cold)
                parts_times.append(time.perf_counter() - start)
        parts = min(parts_times)
        parts_diff = float(
            np.abs(
                parts_out.turn_values("turn_advantages").astype(np.float64)
                - out.turn_values("turn_advantages").astype(np.float64)
            ).max()
        )
        # The reference reads plain Python rows, converted here and not timed.
        rows = batch.to_records()
        reference_times = []
        with gc_paused():
            for _ in range(args.reference_repeats):
                start = time.perf_counter()
                expected = references[name](rows, config)
                reference_times.append(time.perf_counter() - start)
        del rows
        reference = min(reference_times)
        got = out.turn_values("turn_advantages").astype(np.float64)
        want = np.concatenate([np.asarray(turns, dtype=np.float64).ravel() for turns in expected])
        max_diff = float(np.abs(got - want).max())
        turns_per_s = batch.num_turns / vectorized
        speedup = reference / vectorized
        met = (
            speedup >= SPEEDUP_TARGET
            and turns_per_s >= TURNS_PER_S_TARGET.get(name, 0)
            and max_diff < 1e-4
        )
        ok &= met
        target = f">= {SPEEDUP_TARGET:.0f}x" + (
            f", >= {TURNS_PER_S_TARGET[name] / 1e6:.0f} M/s" if name in TURNS_PER_S_TARGET else ""
        )
        print(
            f"{name:<10} {turns_per_s:>12,.0f} {batch.num_turns / reference:>12,.0f} {speedup:>8.1f}x "
            f"{max_diff:>10.1e} {batch.num_turns / parts:>14,.0f} {parts / vectorized:>10.2f}x "
            f"{parts_diff:>10.1e}  {target}: {'met' if met else 'MISSED'}"
        )
        results.append(
            {
                "estimator": name,
                "seconds": vectorized,
                "reference_seconds": reference,
                "turns_per_s": turns_per_s,
                "speedup": speedup,
                "max_abs_diff": max_diff,
                "target_met": met,
                "composition": estimator.composition(config),
                "composition_seconds": parts,
                "composition_over_fused": parts / vectorized,
                "composition_max_abs_diff": parts_diff,
            }
        )

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": " ".join([Path(sys.executable).name, *sys.argv]),
                "machine": {
                    "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                    "processor": platform.machine(),
                },
                "batch": {
                    "trajectories": len(batch),
                    "groups": batch.num_groups,
                    "turns": batch.num_turns,
                },
                "results": results,
            },
            indent=2,
        )
    )
    print(f"wrote {args.out}")
    if not ok:
        print("some targets were missed (see above)")
    return 1 if args.check and not ok else 0


if __name__ == "__main__":
    raise SystemExit(main())
