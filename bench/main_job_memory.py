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

While the job runs, its processes (the driver and everything it starts: Ray's own, the
actors, vLLM's helpers) are read every ``--every`` seconds for their proportional memory
(PSS: each page shared among processes split among them, so the sum counts every page
once). The job's peak is the highest such sum, with what each role held at that moment;
the summed RSS at the same moment, which counts shared pages once per process, is given
beside it. That peak, not the sum of each process's own peak (they fall at different
times), is the memory the job needs.

Exit status 1, naming the role, when a role grows by more than ``--max-growth-gb`` per
step, the node's use passes ``--max-node-gb`` at any step, or the job's peak passes
``--max-job-gb``; JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ROLES = ("learner", "generator", "retriever", "driver")
# a process's role from its command line (Ray names a worker after what it runs)
_ROLE_PREFIXES = (
    ("ray::_LearnerWorker", "learner"), ("ray::Learner", "learner"),
    ("ray::Generator", "generator"), ("ray::RetrieverActor", "retriever"),
    ("ray::RayTrainWorker", "warm-start"), ("ray::TrainController", "warm-start"),
    ("ray::Judge", "judge"), ("ray::Scorer", "scorer"),
)  # fmt: skip


def role_of(cmdline: str, *, driver: bool = False, parent_role: str | None = None) -> str:
    """The role a process of the job plays: the driver, an actor's (its Ray worker's
    name), a helper an actor started (vLLM's, a compiler) as its parent's, else Ray's own
    (the GCS, the raylet, the dashboard and its modules, idle workers)."""
    if driver:
        return "driver"
    for prefix, role in _ROLE_PREFIXES:
        if cmdline.startswith(prefix):
            return role
    if parent_role is not None and parent_role not in ("driver", "ray"):
        return parent_role
    return "ray"


class JobMemory:
    """Reads the proportional memory of ``root`` and its descendants every ``every``
    seconds in a thread, until :meth:`stop`; :meth:`summary` gives the job's peak."""

    def __init__(self, root: int, every: float = 2.0):
        self.root, self.every = root, every
        self.samples: list[dict] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._start = time.monotonic()
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            sample = self.read()
            if sample is not None:
                self.samples.append(sample)
            self._done.wait(self.every)

    def read(self) -> dict | None:
        import psutil

        from ray_credit.process_memory import proportional_gb

        try:
            root = psutil.Process(self.root)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return None
        roles: dict[int, str] = {}
        pss: dict[str, float] = {}
        kinds: dict[str, dict[str, float]] = {}  # a role's PSS by kind of page
        rss_total = 0.0
        for proc in procs:  # parents come before their children
            try:
                cmdline = " ".join(proc.cmdline())
                parent = proc.ppid()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            role = role_of(cmdline, driver=proc.pid == self.root, parent_role=roles.get(parent))
            roles[proc.pid] = role
            reading = proportional_gb(proc.pid)
            if reading is None:  # gone since it was listed
                continue
            pss[role] = pss.get(role, 0.0) + reading["pss"]
            split = kinds.setdefault(role, {"anon": 0.0, "file": 0.0, "shmem": 0.0})
            for kind in split:
                split[kind] += reading[kind]
            rss_total += reading["rss"]
        return {
            "seconds": round(time.monotonic() - self._start, 1),
            "pss_gb": sum(pss.values()),
            "rss_gb": rss_total,
            "roles_pss_gb": pss,
            "roles_kinds_gb": kinds,
        }

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def summary(self) -> dict | None:
        return job_peak(self.samples)


def job_peak(samples: list[dict]) -> dict | None:
    """The sample with the highest summed PSS, and each role's own highest PSS."""
    if not samples:
        return None
    top = max(samples, key=lambda s: s["pss_gb"])
    own: dict[str, float] = {}
    for sample in samples:
        for role, gb in sample["roles_pss_gb"].items():
            own[role] = max(own.get(role, 0.0), gb)
    return {
        "peak_pss_gb": top["pss_gb"],
        "at_seconds": top["seconds"],
        "rss_gb_then": top["rss_gb"],
        "roles_pss_gb_then": dict(sorted(top["roles_pss_gb"].items(), key=lambda kv: -kv[1])),
        # of each role's PSS then: heap (anon), mapped files (file), shared memory (shmem:
        # Ray's object store, where a process reads or writes an object)
        "roles_kinds_gb_then": top.get("roles_kinds_gb", {}),
        "roles_highest_pss_gb": own,
        "samples": len(samples),
    }


def run_main_job(
    steps: int, out_dir: Path, *, evaluate: bool, extra: list[str], every: float = 2.0
) -> tuple[Path, dict | None]:
    """The README's main job for ``steps`` steps, outputs in ``out_dir``: its metrics file
    and its memory over the whole run (:func:`job_peak`)."""
    args = [
        sys.executable, str(ROOT / "pipelines" / "tspo.py"),
        "--name", "memory", "--output_dir", str(out_dir), "--pipeline.steps", str(steps),
        "--wandb", "disabled", *([] if evaluate else ["--eval.enabled", "false"]), *extra,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local Ray of its own
    job = subprocess.Popen(args, cwd=ROOT, env=env)
    meter = JobMemory(job.pid, every)
    code = job.wait()
    meter.stop()
    if code != 0:
        raise SystemExit(f"the main job failed (exit status {code}); see its output above")
    return out_dir / "memory" / "metrics.jsonl", meter.summary()


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
    job = rep.get("job")
    if job is not None:
        then = ", ".join(f"{role} {gb:.2f}" for role, gb in job["roles_pss_gb_then"].items())
        lines.append(
            f"the job's peak: {job['peak_pss_gb']:.2f} GB (PSS, every page once) at "
            f"{job['at_seconds']:.0f} s: {then}; its processes' RSS summed then "
            f"{job['rss_gb_then']:.2f} GB"
        )
        for role, split in job.get("roles_kinds_gb_then", {}).items():
            parts = ", ".join(f"{kind} {gb:.2f}" for kind, gb in split.items())
            lines.append(f"  {role}: {parts}")
    return "\n".join(lines)


def failures(
    rep: dict, max_growth_gb: float, max_node_gb: float | None, max_job_gb: float | None = None
) -> list[str]:
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
    job = rep.get("job")
    if job is not None and max_job_gb is not None and job["peak_pss_gb"] > max_job_gb:
        found.append(
            f"the job's processes held {job['peak_pss_gb']:.2f} GB together at their peak "
            f"(bound {max_job_gb} GB)"
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
    parser.add_argument("--max-job-gb", type=float, default=None,
                        help="the most the job's processes may hold together (GB, PSS)")  # fmt: skip
    parser.add_argument("--every", type=float, default=2.0,
                        help="seconds between readings of the job's processes")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="the report as JSON")
    args, extra = parser.parse_known_args(argv)
    job = None
    if args.metrics is None:
        if args.steps < args.settle + 2:
            parser.error(f"--steps {args.steps}: growth needs at least {args.settle + 2} steps")
        folder = Path(tempfile.mkdtemp(prefix="main-job-memory-"))
        args.metrics, job = run_main_job(
            args.steps, folder, evaluate=args.eval, extra=extra, every=args.every
        )
    rows = [json.loads(line) for line in args.metrics.read_text().splitlines() if line.strip()]
    rep = report(rows, args.settle)
    if job is not None:
        rep["job"] = job
    print(table(rep))
    found = failures(rep, args.max_growth_gb, args.max_node_gb, args.max_job_gb)
    rep["failures"] = found
    if args.out is not None:
        args.out.write_text(json.dumps(rep, indent=2) + "\n")
    for line in found:
        print(f"main_job_memory: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
