"""A 100-step run of the loop on tiny-random (bench/soak.py): nothing grows with the step
count, and nothing is left alive after it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e  # the second test command
@pytest.mark.slow
def test_a_hundred_steps_leak_nothing(ray_cluster):
    sys.path.insert(0, str(ROOT / "bench"))
    from soak import soak, table

    report = soak(100)
    print(table(report))
    summary, after = report["summary"], report["after_shutdown"]
    assert len(report["samples"]) == 100
    # the run's own actors (2 generators, the retriever, the learner) and placement group
    # (the learner's), at every step: nothing created per step, nothing lost
    assert {s["actors_alive"] for s in report["samples"]} == {4.0}, table(report)
    assert {s["placement_groups"] for s in report["samples"]} == {1.0}, table(report)
    # leak bounds, not speed targets: a per-step leak of 1 MB would be 90 MB here
    assert summary["driver_rss_mb"]["change"] < 60, table(report)
    assert summary["object_store_mb"]["change"] < 20, table(report)
    # and nothing of the run is left once it is shut down
    assert after["actors_alive"] == 0 and after["placement_groups"] == 0, table(report)
