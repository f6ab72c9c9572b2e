"""A 100-step run of the loop on tiny-random (bench/soak.py): nothing grows with the step
count, and nothing is left alive after it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_hundred_steps_leak_nothing(ray_cluster):
    sys.path.insert(0, str(ROOT / "bench"))
    from soak import soak, table

    report = soak(100)
    print(table(report))
    summary, base, after = report["summary"], report["baseline"], report["after_shutdown"]
    assert len(report["samples"]) == 100
    # no more actors or placement groups alive in the last ten steps than in the first ten
    # (fewer is possible on the shared cluster: an earlier test's actors may still be dying)
    assert summary["actors_alive"]["change"] <= 0 and summary["placement_groups"]["change"] <= 0
    # leak bounds, not speed targets: a per-step leak of 1 MB would be 90 MB here
    assert summary["driver_rss_mb"]["change"] < 60, table(report)
    assert summary["object_store_mb"]["change"] < 20, table(report)
    # and nothing of the run is left once it is shut down
    assert after["actors_alive"] <= base["actors_alive"]
    assert after["placement_groups"] <= base["placement_groups"]
