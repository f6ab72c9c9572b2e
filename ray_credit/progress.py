"""Progress bars for long work (building an index, an evaluation's rollouts, a step's
generation), drawn only where someone watches.

In the driver a bar is tqdm's, when stderr is a terminal and the run logs at 'info' or
'debug'. In a Ray worker it is Ray's ``tqdm_ray``, which the driver draws (one line per
bar, whatever the number of workers), when the run's driver is such a terminal: the run
says so in its workers' environment (:func:`ray_credit.log.worker_env`). Piped to a file
or a job log, nothing is drawn: the run's one-line messages say what happened.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ray_credit.log import PROGRESS_ENV, log

__all__ = ["NoBar", "progress_bar", "wants_progress"]


class NoBar:
    """A bar that draws nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def wants_progress() -> bool:
    """Whether this driver's bars would be seen: stderr is a terminal, level info or below."""
    return sys.stderr.isatty() and log.getEffectiveLevel() <= 20  # logging.INFO


def progress_bar(total: int, desc: str, *, unit: str = "it") -> Any:
    """A bar of ``total`` steps (``update(n)``, ``close()``), or :class:`NoBar`."""
    if os.environ.get(PROGRESS_ENV) is not None:  # a worker of a run
        if os.environ[PROGRESS_ENV] != "1":
            return NoBar()
        from ray.experimental.tqdm_ray import tqdm

        return tqdm(total=total, desc=desc, unit=unit)
    if not wants_progress():
        return NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, leave=False)
