"""What a pipeline script runs: its config from the command line, then the run, with a
failure said in one line (the traceback in the run's ``error.log``)."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from ray_credit.log import log
from ray_credit.pipeline.configs import EMBEDDED_CONFIG, load_config
from ray_credit.pipeline.recipe import train

__all__ = ["failure_summary", "main", "run_config_class"]


def main(
    cls: type,
    estimator: str,
    doc: str,
    *,
    default_config: str | Path | None = EMBEDDED_CONFIG,
    argv: Sequence[str] | None = None,
    stages: Sequence[Callable] = (),
    stages_after: Sequence[Callable] = (),
) -> dict:
    """What a pipeline script runs: :func:`~ray_credit.pipeline.configs.load_config`
    (``default_config``: the YAML file when no ``--config`` is given; None: the config
    classes' defaults), then :func:`~ray_credit.pipeline.recipe.train` with any extra
    ``stages`` (before the estimator) and ``stages_after`` (after it)."""
    from ray_credit.config import InputError

    prog = Path(sys.argv[0]).name
    try:
        cfg = load_config(cls, estimator, argv, doc=doc, default_config=default_config)
    except InputError as err:  # the user's to fix: one line, as argparse's errors
        raise SystemExit(f"{prog}: error: {err}") from None
    try:
        return train(cfg, estimator, stages=stages, stages_after=stages_after)
    except InputError as err:
        raise SystemExit(f"{prog}: error: {err}") from None
    except Exception as err:  # an actor, a task or the loop failed: one line, not 300
        trace = Path(cfg.output_dir).resolve() / cfg.name / "error.log"
        trace.parent.mkdir(parents=True, exist_ok=True)
        trace.write_text(traceback.format_exc())
        log.debug(trace.read_text())
        raise SystemExit(
            f"{prog}: error: {failure_summary(err)} (traceback: {trace}{_worker_logs()})"
        ) from None


def failure_summary(err: BaseException) -> str:
    """One line naming what failed and why: the remote exception of a failed task or actor
    call (its type, function, process and node), an actor's death, or the error itself."""
    import ray.exceptions

    for cause in _chain(err):
        if isinstance(cause, ray.exceptions.RayTaskError):
            inner = cause.cause
            where = f"{cause.function_name} (pid {cause.pid}, node {cause.ip})"
            return f"{type(inner).__name__} in {where}: {_first_line(inner)}"
    for cause in _chain(err):
        if isinstance(cause, (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError)):
            return f"{type(err).__name__}: {_first_line(err)}; cause: {_first_line(cause)}"
    return f"{type(err).__name__}: {_first_line(err)}"


def _chain(err: BaseException | None):
    """``err`` and the exceptions it was raised from, outermost first."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else "(no message)"


def _worker_logs() -> str:
    """``; worker logs: <the session's log folder>`` while Ray is connected, else ''."""
    import ray

    if not ray.is_initialized():
        return ""
    node = ray._private.worker._global_node  # the only handle on the session's folder
    return f"; worker logs: {node.get_logs_dir_path()}" if node is not None else ""


def run_config_class(script: str | os.PathLike[str], name: str) -> type:
    """The run config class ``name`` of a pipeline script (``pipelines/<method>.py``; the
    scripts are not a package), imported once per process."""
    import importlib.util

    path = Path(script)
    module_name = "pipelines_" + path.stem
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, path)
        sys.modules[module_name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[module_name])
    return getattr(sys.modules[module_name], name)
