"""The README's main job, several steps on its embedded settings, through
bench/main_job_memory.py: no process grows from step to step, and the node's use stays
under a cap that leaves a 24 GB machine room to spare. About 20 minutes on 2 cores (the
warm-start included), so not in CI: `pytest -m bench tests/e2e/test_main_job_memory.py`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("vllm")  # the embedded generator


@pytest.mark.e2e
@pytest.mark.bench
@pytest.mark.slow
def test_the_main_job_holds_its_memory_flat_from_step_to_step(tmp_path):
    out = tmp_path / "memory.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "main_job_memory.py"), "--steps", "6",
         "--max-growth-gb", "0.05", "--max-node-gb", "16", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=3000,
    )  # fmt: skip
    assert out.is_file(), done.stdout[-3000:] + done.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["steps"] == [1, 2, 3, 4, 5, 6]
    assert {"learner", "generator", "retriever", "driver", "node"} <= set(rep["roles"])
    assert done.returncode == 0 and rep["failures"] == [], done.stderr[-2000:]
