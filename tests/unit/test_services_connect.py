"""The local Ray a pipeline script starts (``connect``), beside another Ray on this machine:
its dashboard on a port of its own, and its workers' state API sent there."""

from __future__ import annotations

import socket
import sys
import types

from ray_credit.pipeline.configs import RunConfig
from ray_credit.pipeline.services import connect


def _fake_ray(inits: list[dict]) -> types.ModuleType:
    """A `ray` that records what ``ray.init`` is given and starts nothing."""
    ray = types.ModuleType("ray")
    ray.is_initialized = lambda: False
    ray.init = lambda **kwargs: inits.append(kwargs) or types.SimpleNamespace(dashboard_url="")
    ray.cluster_resources = lambda: {"CPU": 64.0}
    ray.shutdown = lambda: None
    return ray


def test_a_local_ray_has_a_free_dashboard_port_its_workers_are_told_of(monkeypatch):
    # another Ray's dashboard holds the default port (8265) here, and the address file of
    # the last `ray start` names that Ray: a worker left to look would ask it about this
    # run's actors (Ray Train's placement-group cleaner reads its controller as dead)
    inits: list[dict] = []
    monkeypatch.setitem(sys.modules, "ray", _fake_ray(inits))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    connect(RunConfig())
    (init,) = inits
    port = init["dashboard_port"]
    assert init["address"] == "local" and init["include_dashboard"] is True
    env = init["runtime_env"]["env_vars"]
    assert env["RAY_API_SERVER_ADDRESS"] == f"http://127.0.0.1:{port}"
    with socket.socket() as s:  # free now, for Ray to bind
        s.bind(("127.0.0.1", port))


def test_a_run_joining_a_cluster_leaves_its_dashboard_to_it(monkeypatch):
    inits: list[dict] = []
    monkeypatch.setitem(sys.modules, "ray", _fake_ray(inits))
    monkeypatch.setenv("RAY_ADDRESS", "192.0.2.1:6379")
    connect(RunConfig())
    (init,) = inits
    assert init["address"] == "192.0.2.1:6379" and "dashboard_port" not in init
    assert "RAY_API_SERVER_ADDRESS" not in init["runtime_env"]["env_vars"]
