"""The main job's memory, step by step: does any process grow from step to step?

    python bench/main_job_memory.py                          # the README's main job
    python bench/main_job_memory.py --steps 5 --out /tmp/memory.json
    python bench/main_job_memory.py --metrics runs/tspo/metrics.jsonl   # a run made already

Runs ``pipelines/tspo.py`` on its embedded settings (warm-start included; the evaluations
before and after training left out unless ``--eval``) for ``--steps`` steps, in a process
of its own that starts its own local Ray, then reads each step's ``memory/`` metrics from
the run's ``metrics.jsonl`` (docs/metrics.md). For each role (the learner, the largest
generator, the retriever, the driver, Ray's own processes) it reports what the process
holds after each step (``_rss_gb``: after the allocator has handed back what the step
freed), its peak during each step, its highest peak, and its growth: the least-squares
slope of what it holds over the steps after the first ``--settle`` (the first updates
grow the optimizer state and warm the allocator and kernels up). The node's memory in use
is reported the same way.

Exit status 1, naming the role, when a role grows by more than ``--max-growth-gb`` per
step, or the node's use passes ``--max-node-gb`` at any step; JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ROLES = ("learner", "generator", "retriever", "driver")


def run_main_job(steps: int, out_dir: Path, *, evaluate: bool, extra: list[str]) -> Path:
    """The README's main job for ``steps`` steps, outputs in ``out_dir``; its metrics file."""
    args = [
        sys.executable, str(ROOT / "pipelines" / "tspo.py"),
        "--name", "memory", "--output_dir", str(out_dir), "--pipeline.steps", str(steps),
        "--wandb", "disabled", *([] if evaluate else ["--eval.enabled", "false"]), *extra,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local Ray of its own
    done = subprocess.run(args, cwd=ROOT, env=env)
    if done.returncode != 0:
        raise SystemExit(
            f"the main job failed (exit status {done.returncode}); see its output above"
        )
    return out_dir / "memory" / "metrics.jsonl"


def slope(values: list[float]) -> float:
    """Least-squares growth per step of ``values`` (one per step); 0 for fewer than 2."""
    if len(values) < 2:
        return 0.0
    return float(np.polyfit(np.arange(len(values)), values, 1)[0])


def report(rows: list[dict], settle: int) -> dict:
    """Per role: what it held after each step, its peak per step, its highest peak, and
    its growth per step after the first ``settle`` steps; the node's use likewise."""
    out: dict = {"steps": [int(r["pipeline/step"]) for r in rows], "settle": settle, "roles": {}}
    series = {role: (f"memory/{role}_rss_gb", f"memory/{role}_peak_gb") for role in ROLES}
    series["ray"] = ("memory/ray_gb", None)
    series["node"] = ("memory/node_used_gb", None)
    for role, (held_key, peak_key) in series.items():
        held = [r.get(held_key) for r in rows]
        if all(v is None for v in held):
            continue  # not measured (a role a run does not have, or no /proc)
        # a service answers a step late, or not at all on its first: its own steps only
        measured = [v for v in held if v is not None]
        peaks = [r.get(peak_key) for r in rows] if peak_key else held
        out["roles"][role] = {
            "held_gb": held,
            "peak_gb": peaks,
            "highest_peak_gb": max(v for v in peaks if v is not None),
            "growth_gb_per_step": slope(measured[settle:]),
        }
    if rows and "memory/node_total_gb" in rows[0]:
        out["node_total_gb"] = rows[0]["memory/node_total_gb"]
    return out


def table(rep: dict) -> str:
    lines = [
        f"{'role':<10} {'highest peak GB':>16} {'growth GB/step':>15}   held after each step (GB)",
    ]
    for role, r in rep["roles"].items():
        held = " ".join("-" if v is None else f"{v:.2f}" for v in r["held_gb"])
        lines.append(
            f"{role:<10} {r['highest_peak_gb']:>16.2f} {r['growth_gb_per_step']:>+15.3f}   {held}"
        )
    if "node_total_gb" in rep:
        lines.append(f"(node: {rep['node_total_gb']:.1f} GB in all; growth over steps after "
                     f"the first {rep['settle']})")  # fmt: skip
    return "\n".join(lines)


def failures(rep: dict, max_growth_gb: float, max_node_gb: float | None) -> list[str]:
    """What breaks the bounds, in words (nothing: the run's memory is flat and fits)."""
    found = []
    for role, r in rep["roles"].items():
        if role != "node" and r["growth_gb_per_step"] > max_growth_gb:
            found.append(
                f"{role} grows by {r['growth_gb_per_step']:.3f} GB per step after step "
                f"{rep['settle']} (bound {max_growth_gb} GB)"
            )
    node = rep["roles"].get("node")
    if node is not None and max_node_gb is not None and node["highest_peak_gb"] > max_node_gb:
        found.append(
            f"the node's memory in use reached {node['highest_peak_gb']:.1f} GB (bound "
            f"{max_node_gb} GB)"
        )
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="steps of the main job (12: its own)")
    parser.add_argument("--metrics", type=Path, default=None,
                        help="read this metrics.jsonl instead of running the job")  # fmt: skip
    parser.add_argument("--eval", action="store_true", help="keep the evaluations before and after")
    parser.add_argument("--settle", type=int, default=2, help="steps left out of the growth")
    parser.add_argument("--max-growth-gb", type=float, default=0.05,
                        help="the most a role may grow per step (GB)")  # fmt: skip
    parser.add_argument("--max-node-gb", type=float, default=None,
                        help="the most the node may use at any step (GB)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="the report as JSON")
    args, extra = parser.parse_known_args(argv)
    if args.metrics is None:
        if args.steps < args.settle + 2:
            parser.error(f"--steps {args.steps}: growth needs at least {args.settle + 2} steps")
        folder = Path(tempfile.mkdtemp(prefix="main-job-memory-"))
        args.metrics = run_main_job(args.steps, folder, evaluate=args.eval, extra=extra)
    rows = [json.loads(line) for line in args.metrics.read_text().splitlines() if line.strip()]
    rep = report(rows, args.settle)
    print(table(rep))
    found = failures(rep, args.max_growth_gb, args.max_node_gb)
    rep["failures"] = found
    if args.out is not None:
        args.out.write_text(json.dumps(rep, indent=2) + "\n")
    for line in found:
        print(f"main_job_memory: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
