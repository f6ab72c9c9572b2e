"""The examples run as users run them."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_custom_estimator_example_runs_without_touching_the_library():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "custom_estimator.py")],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    assert "turn advantages" in out.stdout
    assert "discounted_grpo/mean_discount" in out.stdout
