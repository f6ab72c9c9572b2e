"""The pipeline scripts' command lines: --help everywhere, bad flags named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_help_and_bad_flags():
    env = None
    for script in (
        "grpo.py",
        "tspo.py",
        "cw_grpo.py",
        "search_p1.py",
        "igpo.py",
        "a2tgpo.py",
        "gigpo.py",
        "eval.py",
    ):
        out = subprocess.run(
            [sys.executable, str(ROOT / "pipelines" / script), "--help"],
            capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0 and "--data.questions" in out.stdout, script
    bad = subprocess.run(
        [sys.executable, str(ROOT / "pipelines" / "tspo.py"), "--pipeline.steps", "zero"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "--pipeline.steps" in bad.stderr
