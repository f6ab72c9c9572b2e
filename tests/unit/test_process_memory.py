"""Process memory readings: the peak between readings, and the allocator's free pages
handed back (Linux; the readings are None elsewhere)."""

from __future__ import annotations

import sys

import pytest

from ray_credit.process_memory import (
    PeakMeter,
    memory_report,
    node_memory,
    proportional_gb,
    ray_processes_gb,
    release_free_memory,
    resident_gb,
)

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@linux
def test_the_peak_is_that_of_the_window_since_the_last_reading():
    meter = PeakMeter()
    block = bytearray(400 * 2**20)  # touched: 400 MiB resident
    block[::4096] = b"x" * len(block[::4096])
    del block
    _, peak = meter.read()
    now, quiet = meter.read()  # nothing was allocated in this window
    assert meter.windowed
    assert peak - now > 0.3  # the block was counted in the first window
    assert quiet - now < 0.05  # and is not in the second


@linux
def test_a_report_gives_back_freed_pages_first():
    import numpy as np

    meter = PeakMeter()
    # 64 KiB blocks, below glibc's mmap threshold, so they come from the heap; one in 64
    # kept alive pins the heap's top, so free() alone returns nothing (checked below)
    blocks = [np.ones(2**13) for _ in range(16_000)]  # ~1 GiB
    held = resident_gb()
    kept = blocks[::64]
    del blocks
    assert resident_gb() > held - 0.1  # freed, yet still resident
    report = memory_report(meter)
    assert report["peak_gb"] >= held - 0.05
    assert report["rss_gb"] < held - 0.7, (held, report)  # handed back to the kernel
    assert len(kept) == 250
    assert release_free_memory()


@linux
def test_node_memory_and_ray_processes_of_another_session_are_not_counted():
    node = node_memory()
    assert 0 < node["used"] < node["total"]
    assert ray_processes_gb("/tmp/ray/no_such_session_folder") == 0.0


@linux
def test_proportional_memory_counts_a_page_two_processes_share_once():
    import os
    import signal
    import time

    block = bytearray(b"x" * (300 * 2**20))  # 300 MiB, touched, then shared with a fork
    child = os.fork()
    if child == 0:  # the copy-on-write child holds the same pages and waits
        time.sleep(60)
        os._exit(0)
    try:
        time.sleep(0.2)
        ours, theirs = proportional_gb(), proportional_gb(child)
        both_rss = ours["rss"] + theirs["rss"]
        both_pss = ours["pss"] + theirs["pss"]
        assert both_rss - both_pss > 0.25  # the block counted twice in RSS, once in PSS
        assert ours["anon"] > 0.13 and theirs["anon"] > 0.13  # half of it each
        # the kernel sums the parts exactly but rounds each field down to a kB on its own:
        # the whole exceeds the sum of the three rounded parts by 0, 1 or 2 kB
        kb = 2**10 / 2**30
        gap = ours["pss"] - (ours["anon"] + ours["file"] + ours["shmem"])
        assert -1e-12 <= gap <= 2 * kb + 1e-12
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    del block
    assert proportional_gb(child) is None  # gone
