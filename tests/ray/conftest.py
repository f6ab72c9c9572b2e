"""One local Ray cluster for every test under tests/ray (starting Ray costs seconds)."""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray")


@pytest.fixture(scope="session")
def ray_cluster():
    """A local cluster with 4 logical CPUs on this 2-core machine: actors here mostly wait on
    each other, and tests need a retriever, a generator and a judge alive at once."""
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if ray.is_initialized():
        yield ray
        return
    # address="local": our own cluster, whatever `ray start` head runs (or ran) here. With
    # its dashboard, as the pipelines start theirs: Ray Train's placement-group cleaner
    # asks the state API whether a training's controller lives, and without one here it
    # would ask whatever Ray's dashboard holds the default port on this machine
    ray.init(address="local", num_cpus=4, include_dashboard=True, log_to_driver=True)
    try:
        yield ray
    finally:
        ray.shutdown()


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/ray/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.ray)
