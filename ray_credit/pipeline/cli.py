"""What a pipeline script runs: its config from the command line, then the run, with a
failure said in one line (the traceback in the run's ``error.log``)."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ray_credit.log import log
from ray_credit.pipeline.configs import EMBEDDED_CONFIG, load_config
from ray_credit.pipeline.recipe import train

__all__ = ["composed_estimator", "failure_summary", "main", "run_config_class"]


def main(
    cls: type,
    estimator: str | None,
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
    ``stages`` (before the estimator) and ``stages_after`` (after it). ``estimator`` None:
    the composition of parts the run config's ``estimator`` setting writes
    (``pipelines/compose.py --estimator "folr + 0.3*info_gain | turn_position"``)."""
    from ray_credit.config import InputError

    prog = Path(sys.argv[0]).name
    try:
        if estimator is None:
            estimator = composed_estimator(cls, argv, default_config)
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


def composed_estimator(
    cls: type,
    argv: Sequence[str] | None = None,
    default_config: str | Path | None = EMBEDDED_CONFIG,
) -> Any:
    """The estimator a run config's ``estimator`` setting writes, a composition of parts
    or a registered estimator's name, read as the run's settings will be (the flag, else
    the run ``--resume`` continues, else ``--config``'s file, else the class's default),
    so that the recipe its parts declare becomes the run's defaults. A composition that
    cannot work is refused here, before Ray starts, with the reason."""
    import argparse

    import yaml

    from ray_credit.config import InputError
    from ray_credit.estimators import get_estimator
    from ray_credit.estimators.compose import CompositionError, compose, is_composition
    from ray_credit.pipeline.configs import _resumed_settings

    argv = list(sys.argv[1:] if argv is None else argv)
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--estimator")
    first.add_argument("--config")
    known, _ = first.parse_known_args(argv)
    text, source = known.estimator, "--estimator"
    if text is None:
        resumed = _resumed_settings(argv) or {}
        text, source = resumed.get("estimator"), "the resumed run's estimator"
    config_file = known.config or default_config
    if text is None and config_file is not None and Path(config_file).is_file():
        loaded = yaml.safe_load(Path(config_file).read_text()) or {}
        text, source = loaded.get("estimator"), f"{config_file}'s estimator"
    if text is None:
        text, source = cls().estimator, "the estimator setting's default"
    if not isinstance(text, str):
        raise InputError(f"{source} is a composition of parts as text, got {text!r}")
    try:
        if is_composition(text):
            return compose(text)
        paper = get_estimator(text)  # a paper's name: its composition, with its recipe
        if paper.composition is None or paper.composition(paper.config_cls()) is None:
            raise InputError(f"{source} {text!r} has no composition of parts")
        return compose(
            paper.composition(paper.config_cls()),
            learner=paper.learner,
            description=f"{text} as parts: {paper.description}",
        )
    except CompositionError as err:
        raise InputError(f"{source} {text!r}: {err}") from None
    except KeyError:
        from ray_credit.estimators import ESTIMATORS
        from ray_credit.estimators.parts import PARTS

        raise InputError(
            f'{source} {text!r} is neither a composition of parts (e.g. "outcome + '
            f"0.5*folr | turn_position\"; parts: {', '.join(PARTS)}) nor an estimator's "
            f"name ({', '.join(ESTIMATORS)})"
        ) from None
