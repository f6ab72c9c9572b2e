"""One local Ray cluster for every test under tests/ray (starting Ray costs seconds)."""

from __future__ import annotations

import os

import pytest

from tests._ports import free_ports

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
    # would ask whatever Ray's dashboard holds the default port on this machine. On a free
    # port that every worker here is told of (the raylet starts them, the scripts' jobs'
    # too, with the environment it started with): left to look, the state API in a worker
    # asks the cluster that the last `ray start` on this machine recorded, or gives up
    # among several. Set only while Ray starts: the scripts the tests start inherit this
    # process's environment, and one that starts a Ray of its own has a dashboard of its own.
    (port,) = free_ports(1)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_API_SERVER_ADDRESS", f"http://127.0.0.1:{port}")
        ray.init(address="local", num_cpus=4, include_dashboard=True, dashboard_port=port,
                 log_to_driver=True)  # fmt: skip
    try:
        yield ray
    finally:
        ray.shutdown()


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/ray/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.ray)
