"""bench/main_job_memory.py's reading of a run's memory/ metrics: growth per step after the
first steps, each role's highest peak, and the bounds it holds a run to."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from main_job_memory import failures, main, report  # noqa: E402


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
