"""The Ray examples run as users run them, against the shared cluster (RAY_ADDRESS)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_rollout_services_example(ray_cluster):
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "rollout_services.py"), "--model", "tiny-random"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "8 trajectories" in out.stdout
    assert "gen/searches" in out.stdout and "judge/requests" in out.stdout
    for name in ("grpo", "tspo", "cw_grpo", "search_p1", "igpo", "a2tgpo", "gigpo"):
        assert f"\n{name} " in out.stdout, name


def test_compose_stages_example(ray_cluster):
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "compose_stages.py"), "--steps", "2"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step 2: reward" in out.stdout and "no-search trajectories" in out.stdout
    assert "trained groups 0..7, policy version 2" in out.stdout
