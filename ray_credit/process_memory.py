"""How much memory a process holds, and handing back what it freed.

Every long-lived process of a run reports its resident memory with its work: the learner
with each update, a generator with each chunk, the services when asked once a step, the
driver for itself. :class:`PeakMeter` gives the peak *since the last reading* (Linux's
``VmHWM``, reset through ``/proc/self/clear_refs``), so a step's figure is that step's
peak, not the process's lifetime one, and growth from step to step shows.

:func:`release_free_memory` asks glibc's allocator to give back to the kernel the pages it
holds free (``malloc_trim``). PyTorch's CPU tensors come from that allocator; after an
update of varying shapes its arenas keep freed blocks mapped, and a learner's resident
memory would otherwise ratchet up by a GB or more over a run's first steps although no
tensor outlives the update.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

__all__ = [
    "GiB",
    "PeakMeter",
    "memory_report",
    "node_memory",
    "proportional_gb",
    "ray_processes_gb",
    "release_free_memory",
    "resident_gb",
]

GiB = 2**30
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def resident_gb(pid: int | None = None) -> float | None:
    """Resident memory (RSS) of this process, or of ``pid``, in GiB; None where the
    platform does not say (no ``/proc``) or the process is gone."""
    return _status_gb("VmRSS", pid)


def proportional_gb(pid: int | None = None) -> dict[str, float] | None:
    """Proportional memory of this process, or of ``pid``, in GiB (Linux's
    ``smaps_rollup``): ``pss``, its resident pages with each page shared with other
    processes split among them (a library's code that five processes map counts a fifth
    in each), and of it ``anon`` (heap: tensors, Python objects), ``file`` (mapped
    files: libraries, memory-mapped indexes) and ``shmem`` (shared memory: Ray's object
    store, where a process reads an object without a copy); ``rss`` as :func:`resident_gb` for
    comparison. Summed over processes, ``pss`` counts every page once: the physical
    memory they hold together, where summed RSS counts shared pages once per process.
    None where the platform does not say (no ``/proc``, or not ours to read)."""
    path = Path(f"/proc/{'self' if pid is None else pid}/smaps_rollup")
    try:
        text = path.read_text()
    except OSError:
        return None
    fields = {}
    for line in text.splitlines()[1:]:
        key, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB":
            fields[key] = int(parts[0]) * 1024 / GiB
    if "Pss" not in fields:
        return None
    return {
        "pss": fields["Pss"],
        "anon": fields.get("Pss_Anon", 0.0),
        "file": fields.get("Pss_File", 0.0),
        "shmem": fields.get("Pss_Shmem", 0.0),
        "rss": fields.get("Rss", 0.0),
    }


def _status_gb(field: str, pid: int | None = None) -> float | None:
    path = _STATUS if pid is None else Path(f"/proc/{pid}/status")
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / GiB
    return None


class PeakMeter:
    """This process's peak resident memory between readings.

    :meth:`read` returns ``(resident now, peak since the previous read)`` in GiB and starts
    a new window. Where the kernel does not let the peak be reset (not Linux, or a
    restricted ``/proc``), the peak is the process's lifetime peak and ``windowed`` is
    False; where nothing can be read, both are None.
    """

    def __init__(self) -> None:
        self.windowed = self._reset()

    def read(self) -> tuple[float | None, float | None]:
        now, peak = resident_gb(), _status_gb("VmHWM")
        self.windowed = self._reset()
        return now, peak

    @staticmethod
    def _reset() -> bool:
        try:
            _CLEAR_REFS.write_text("5")  # 5: reset the peak resident set size (Linux >= 4.0)
        except OSError:
            return False
        return True


def memory_report(meter: PeakMeter) -> dict[str, float] | None:
    """``{"rss_gb", "peak_gb"}`` of this process: what it holds once the allocator has
    given back what was freed (:func:`release_free_memory`), and its peak since
    ``meter``'s last reading; None where the platform does not say."""
    release_free_memory()
    resident, peak = meter.read()
    return None if resident is None else {"rss_gb": resident, "peak_gb": peak}


@functools.cache
def _malloc_trim():
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


def release_free_memory() -> bool:
    """Give the pages glibc's allocator holds free back to the kernel (``malloc_trim(0)``);
    False where the C library has no such call. It takes milliseconds, and frees nothing
    that is in use."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def node_memory() -> dict[str, float] | None:
    """This node's memory in GiB: ``total``, ``used`` (total less what the kernel counts
    available) and ``shared`` (``/dev/shm``, where Ray's object store lives); None
    without ``/proc/meminfo``."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    info = {}
    for line in lines:
        key, _, value = line.partition(":")
        info[key] = int(value.split()[0]) * 1024 / GiB
    if "MemAvailable" not in info:
        return None
    return {
        "total": info["MemTotal"],
        "used": info["MemTotal"] - info["MemAvailable"],
        "shared": info.get("Shmem", 0.0),
    }


def ray_processes_gb(session_dir: str) -> float | None:
    """Resident memory of Ray's own processes on this node, in GiB: the GCS, the raylet,
    the dashboard and its agents, the monitors and the idle workers, not the workers that
    run actors or tasks (those are counted as what they run). ``session_dir``: the Ray
    session's folder, which each of Ray's own processes names on its command line (and
    every other Ray instance on the machine does not). None where ``psutil`` (a Ray
    dependency) is missing."""
    try:
        import psutil
    except ImportError:
        return None
    children: dict[int, list[int]] = {}
    info: dict[int, tuple[str, int]] = {}
    roots = []
    for proc in psutil.process_iter(["pid", "ppid", "cmdline", "memory_info"]):
        pid, cmdline = proc.info["pid"], " ".join(proc.info["cmdline"] or ())
        if proc.info["memory_info"] is None:  # gone, or not ours to read
            continue
        info[pid] = (cmdline, proc.info["memory_info"].rss)
        children.setdefault(proc.info["ppid"], []).append(pid)
        if session_dir in cmdline:
            roots.append(pid)
    seen, stack, total = set(), list(roots), 0
    while stack:  # Ray's processes and what they started (the dashboard's modules, workers)
        pid = stack.pop()
        if pid in seen or pid not in info or pid == os.getpid():
            continue
        seen.add(pid)
        stack.extend(children.get(pid, ()))
        cmdline, rss = info[pid]
        if not cmdline.startswith("ray::") or cmdline.startswith(_RAY_OWN_WORKERS):
            total += rss
    return total / GiB


# worker processes that are Ray's own, not a task's or an actor's
_RAY_OWN_WORKERS = ("ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent")
