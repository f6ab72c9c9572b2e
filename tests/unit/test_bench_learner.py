"""bench/learner.py --micro-batch-memory: each micro-batch size measured in a process of
its own (a peak is per process), its peak and update time reported with the ratios to the
first value, and written beside --out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e  # two training processes of the bench script: the second test command
@pytest.mark.bench
def test_micro_batch_memory_measures_each_value_in_its_own_process(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "learner.py"), "--model", "tiny-random",
         "--questions", "2", "--group_size", "2", "--repeats", "1",
         "--micro-batch-memory", "512,128", "--out", str(tmp_path / "learner.json")],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "learner_memory.json").read_text())
    first, second = report["memory"]
    assert [first["micro_batch_tokens"], second["micro_batch_tokens"]] == [512, 128]
    for r in (first, second):
        assert 0 < r["loaded_gb"] <= r["peak_gb"] and r["seconds"] > 0
    assert first["peak_ratio"] == 1.0 and first["time_ratio"] == 1.0
    assert second["peak_ratio"] == second["peak_gb"] / first["peak_gb"]
    assert "micro_batch_tokens    128: peak" in out.stdout
