"""bench/main_job_memory.py's reading of a run's memory/ metrics: growth per step after the
first steps, each role's highest peak, and the bounds it holds a run to."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from main_job_memory import JobMemory, failures, job_peak, main, report, role_of  # noqa: E402


def _rows(learner: list[float], *, node: list[float] | None = None) -> list[dict]:
    rows = []
    for i, held in enumerate(learner):
        row = {
            "pipeline/step": i + 1,
            "memory/learner_rss_gb": held,
            "memory/learner_peak_gb": held + 3.0,
            "memory/driver_rss_gb": 0.7,
            "memory/driver_peak_gb": 0.7,
            "memory/node_used_gb": (node or [10.0] * len(learner))[i],
            "memory/node_total_gb": 23.5,
        }
        if i:  # a service's answer comes a step late: none at step 1
            row["memory/retriever_rss_gb"] = row["memory/retriever_peak_gb"] = 0.8
        rows.append(row)
    return rows


def test_a_flat_run_passes_and_its_first_steps_are_left_out_of_the_growth():
    # the optimizer state and the allocator's warm-up: 3.2 -> 4.2 GB, then flat
    rep = report(_rows([3.2, 4.2, 4.3, 4.3, 4.3, 4.3]), settle=2)
    assert rep["roles"]["learner"]["growth_gb_per_step"] == pytest.approx(0.0, abs=1e-9)
    assert rep["roles"]["learner"]["highest_peak_gb"] == pytest.approx(7.3)
    assert rep["roles"]["retriever"]["held_gb"][0] is None
    assert "generator" not in rep["roles"]  # not measured: not reported
    assert failures(rep, 0.05, 16) == []


def test_a_role_that_grows_or_a_node_over_its_cap_is_named():
    rep = report(_rows([3.0, 4.0, 4.1, 4.2, 4.3, 4.4], node=[10, 11, 12, 13, 14, 17]), settle=2)
    assert rep["roles"]["learner"]["growth_gb_per_step"] == pytest.approx(0.1)
    found = failures(rep, 0.05, 16)
    assert found == [
        "learner grows by 0.100 GB per step after step 2 (bound 0.05 GB)",
        "the node's memory in use reached 17.0 GB (bound 16 GB)",
    ]


def test_the_command_reads_a_runs_metrics_and_exits_1_on_growth(tmp_path, capsys):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in _rows([3, 4, 4.2, 4.4, 4.6])))
    out = tmp_path / "memory.json"
    assert main(["--metrics", str(metrics), "--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert "learner grows by 0.200 GB per step" in captured.err
    assert captured.out.splitlines()[0].split()[:4] == ["role", "highest", "peak", "GB"]
    assert json.loads(out.read_text())["failures"] == [
        "learner grows by 0.200 GB per step after step 2 (bound 0.05 GB)"
    ]


def test_each_process_of_the_job_is_given_its_role():
    assert role_of("python pipelines/tspo.py", driver=True) == "driver"
    assert role_of("ray::_LearnerWorker.train") == "learner"
    assert role_of("ray::Generator.generate") == "generator"
    assert role_of("ray::RayTrainWorker") == "warm-start"
    assert role_of("/usr/bin/cc1plus -O2", parent_role="generator") == "generator"  # its helper
    assert role_of("ray::IDLE", parent_role="ray") == "ray"
    assert role_of("/ray/core/src/ray/raylet/raylet", parent_role="driver") == "ray"


def test_the_jobs_peak_is_the_highest_sum_at_one_moment_not_the_sum_of_peaks():
    samples = [
        {"seconds": 1, "pss_gb": 6.0, "rss_gb": 7.0, "roles_pss_gb": {"learner": 5.0, "ray": 1.0}},
        {"seconds": 2, "pss_gb": 7.0, "rss_gb": 9.0,
         "roles_pss_gb": {"learner": 2.0, "generator": 4.0, "ray": 1.0}},
    ]  # fmt: skip
    peak = job_peak(samples)
    assert (peak["peak_pss_gb"], peak["at_seconds"], peak["rss_gb_then"]) == (7.0, 2, 9.0)
    assert list(peak["roles_pss_gb_then"]) == ["generator", "learner", "ray"]
    assert peak["roles_highest_pss_gb"] == {"learner": 5.0, "ray": 1.0, "generator": 4.0}
    rep = {"roles": {}, "job": peak}
    assert failures(rep, 0.05, None, max_job_gb=8) == []
    assert failures(rep, 0.05, None, max_job_gb=6.5) == [
        "the job's processes held 7.00 GB together at their peak (bound 6.5 GB)"
    ]
    assert job_peak([]) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_meter_reads_a_process_and_what_it_started():
    import subprocess

    code = (
        "import subprocess, sys, time; block = bytearray(b'x' * (200 * 2**20)); "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
        "time.sleep(30)"
    )
    job = subprocess.Popen([sys.executable, "-c", code])
    try:
        meter = JobMemory(job.pid, every=0.2)
        import time

        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (
            meter.samples and "ray" in meter.samples[-1]["roles_pss_gb"]
        ):
            time.sleep(0.2)
        meter.stop()
    finally:
        import psutil

        for child in psutil.Process(job.pid).children(recursive=True):
            child.kill()
        job.kill()
        job.wait()
    last = meter.samples[-1]
    assert last["roles_pss_gb"]["driver"] > 0.19  # the 200 MiB block, the job's root
    driver = last["roles_kinds_gb"]["driver"]
    assert driver["anon"] > 0.19  # the block is heap
    assert sum(driver.values()) == pytest.approx(last["roles_pss_gb"]["driver"], abs=1e-5)
    assert last["roles_pss_gb"]["ray"] > 0  # its child (no actor's name): counted too
    assert last["rss_gb"] >= last["pss_gb"]
