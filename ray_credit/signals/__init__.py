"""Signals: the columns that stages add to a batch for the estimators to read.

Every module of this package whose name does not start with ``_`` is imported here and
contributes the signals in its module-level ``SIGNALS`` tuple: their columns join the
batch schema (:data:`ray_credit.batch.COLUMNS`) and their names the registry, so adding
a signal is one new module (plus its test). A user registers their own at run time with
:func:`register_signal`. Built in:

* ``cw_grpo_judgement``: CW-GRPO's per-turn utility and correctness (a judge);
* ``search_p1_evaluation``: Search-P1's evaluator fields per trajectory (a judge);
* ``reference_plan``: Search-P1's reference plan per question (a judge, before training);
* ``info_gain``: IGPO's and A²TGPO's per-turn information gain (the policy itself).

This package imports only numpy and pyarrow.
"""

from __future__ import annotations

from ray_credit._registry import discover
from ray_credit.batch import register_columns
from ray_credit.signals._base import (
    JudgedSignal,
    Request,
    Signal,
    parse_json_object,
    render_trace,
)
from ray_credit.signals._reply import Choice, Count, Strings

__all__ = [
    "SIGNALS",
    "Choice",
    "Count",
    "JudgedSignal",
    "Request",
    "Signal",
    "Strings",
    "get_signal",
    "parse_json_object",
    "register_signal",
    "render_trace",
]

SIGNALS: dict[str, Signal] = {}


def register_signal(signal: Signal, *, overwrite: bool = False) -> Signal:
    """Add a signal (an instance: its default settings) to :data:`SIGNALS` and its
    columns to the batch schema; refuses to shadow a name unless told."""
    if not isinstance(signal, Signal):
        raise TypeError(f"register_signal takes a Signal instance, got {type(signal).__name__}")
    if signal.name in SIGNALS and not overwrite:
        raise ValueError(
            f"a signal named {signal.name!r} is already registered; pick another name or "
            "pass overwrite=True"
        )
    register_columns(signal.columns)
    SIGNALS[signal.name] = signal
    return signal


def get_signal(name: str) -> Signal:
    """The registered signal called ``name`` (its default settings)."""
    try:
        return SIGNALS[name]
    except KeyError:
        raise KeyError(
            f"unknown signal {name!r}; registered: {sorted(SIGNALS)}. Register your own with "
            "ray_credit.signals.register_signal."
        ) from None


discover(__name__, __path__, "SIGNALS", register_signal)
