"""Free ports for the Ray heads the tests start, so that they run beside another Ray on
this machine: a `ray start --head` left to its defaults takes 6379 (GCS), 8265 (dashboard),
52365 (dashboard agent), 10001 (Ray Client) and its workers' range 10002-19999, and a
second head on any of these fails in its own way (the GCS does not start; the dashboard
does not start; the agent stays up without its HTTP server, so no job is ever taken)."""

from __future__ import annotations

import contextlib
import socket


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on this machine now: all bound to port 0 at once (so
    the kernel hands each a different one), read, then released for Ray to bind."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in sockets]


# The `ray start` ports whose defaults are fixed numbers. Every other port a head opens
# (node and object manager, the agents' gRPC, the runtime-env agent, metrics export, the
# dashboard's gRPC) is already one the kernel picks when Ray binds it.
FIXED_DEFAULT_PORTS = (
    "port",
    "dashboard-port",
    "dashboard-agent-listen-port",
    "ray-client-server-port",
)


def ray_start_port_flags() -> tuple[dict[str, int], list[str]]:
    """Free ports for a `ray start --head`: the port of each of FIXED_DEFAULT_PORTS (by
    flag name), and the flags that give them, with workers on ports the kernel picks
    instead of the fixed range another head's workers bind in."""
    ports = dict(zip(FIXED_DEFAULT_PORTS, free_ports(len(FIXED_DEFAULT_PORTS)), strict=True))
    flags = [f"--{name}={port}" for name, port in ports.items()]
    return ports, [*flags, "--min-worker-port=0", "--max-worker-port=0"]
