"""What a run prints: the ``ray_credit`` logger, its level, and the quiet settings for the
libraries under it.

The pipelines' own lines (the data, the warm-start, each step, each evaluation, notes)
go through ``logging.getLogger("ray_credit")`` to stdout, one line each, at the run's
``log_level`` (``--log_level warning`` keeps only warnings and errors). The actors' lines
(the index built or loaded, the model converted once) go through the same logger in
their processes, which read the level from ``RAY_CREDIT_LOG_LEVEL``; Ray forwards them.

Set ``RAY_CREDIT_CONFIGURE_LOGGING=0`` to configure the ``ray_credit`` logger yourself.

The libraries under the actors are quieted at their source, through the environment the
run gives its workers (:func:`worker_env`): vLLM logs warnings only, transformers errors
only and no progress bars, PyTorch's C++ warnings (NUMA binding) are off, and Python's
FutureWarning / DeprecationWarning from library code are not shown. ``--log_level debug``
shows all of it.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Literal, get_args

__all__ = ["LEVELS", "PROGRESS_ENV", "LogLevel", "log", "setup_logging", "worker_env"]

LogLevel = Literal["debug", "info", "warning", "error"]
LEVELS = get_args(LogLevel)
ENV = "RAY_CREDIT_LOG_LEVEL"
PROGRESS_ENV = "RAY_CREDIT_PROGRESS"  # "1": the driver draws workers' bars (ray_credit.progress)

log = logging.getLogger("ray_credit")


def setup_logging(level: LogLevel = "info") -> None:
    """Send the ``ray_credit`` logger's records at ``level`` and above to stdout, as plain
    lines (a pipeline's progress is read by people and by tests alike). Idempotent."""
    if level not in LEVELS:
        raise ValueError(f"log_level must be one of {list(LEVELS)}, got {level!r}")
    log.setLevel(level.upper())
    if not any(isinstance(h, _Stdout) for h in log.handlers):
        handler = _Stdout()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    log.propagate = False  # one line per record, whatever the root logger does


class _Stdout(logging.StreamHandler):
    """A handler writing to whatever ``sys.stdout`` is when a record comes (a redirect or a
    test's capture made after the handler was)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler sets it once; the property wins
        pass


def worker_env(level: LogLevel = "info", *, progress: bool = False) -> dict[str, str]:
    """The environment variables that make the run's workers as quiet as ``level``: for a
    Ray ``runtime_env``'s ``env_vars``. ``progress``: workers send progress bars to the
    driver (it draws them on a terminal)."""
    if level not in LEVELS:
        raise ValueError(f"log_level must be one of {list(LEVELS)}, got {level!r}")
    debug = level == "debug"
    env = {
        ENV: level,
        PROGRESS_ENV: "1" if progress else "0",
        # vLLM's engine start-up is ~40 INFO lines per engine
        "VLLM_LOGGING_LEVEL": "INFO" if debug else ("WARNING" if level == "info" else "ERROR"),
        "TRANSFORMERS_VERBOSITY": "info" if debug else "error",
        "TORCH_CPP_LOG_LEVEL": "INFO" if debug else "ERROR",
    }
    if not debug:
        env["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # "Loading weights" bars of every actor
        env["PYTHONWARNINGS"] = "ignore::FutureWarning,ignore::DeprecationWarning"
    return env


# As vLLM and Ray do for theirs, the logger is set up on import: the library's lines are
# its progress report (at RAY_CREDIT_LOG_LEVEL in a run's workers, which the run sets; info
# elsewhere). RAY_CREDIT_CONFIGURE_LOGGING=0 leaves it to the application's logging config.
if os.environ.get("RAY_CREDIT_CONFIGURE_LOGGING", "1") != "0":
    _level = os.environ.get(ENV, "info")
    setup_logging(_level if _level in LEVELS else "info")  # type: ignore[arg-type]
