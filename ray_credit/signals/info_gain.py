"""Information gain: how much each turn raised the policy's belief in the gold answer.

IGPO (arXiv 2510.14967) and A²TGPO (docs/estimators.md) reward a turn by
the change in the acting policy's probability of the gold answer from the context before
the turn to the context after it (its observation included). The
:class:`~ray_credit.actors.scorer.InfoGainScorer` computes it with batched forward passes
of the policy; the pipeline runs it on every chunk as it is generated, with the weights
that sampled the chunk. Column: ``turn_info_gain`` (float32 per turn, null on
the final turn and where the score is not finite).

Settings: ``mode`` (``prob_diff``: ``exp(m_after) - exp(m_before)``, IGPO's default;
``log_prob_diff``: ``m_after - m_before``, IGPO's 745078b script and A²TGPO's code) and
``max_batch_tokens`` (padded tokens per forward pass).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

import pyarrow as pa

from ray_credit.batch import ColumnSpec
from ray_credit.signals._base import Signal

Mode = Literal["prob_diff", "log_prob_diff"]
MODES = get_args(Mode)


@dataclass(frozen=True)
class InfoGain(Signal):
    """Per-turn information gain of the gold answer (module docstring)."""

    name: ClassVar[str] = "info_gain"
    service: ClassVar[str] = "scorer"
    columns: ClassVar[Mapping[str, ColumnSpec]] = {
        "turn_info_gain": ColumnSpec(
            pa.list_(pa.float32()),
            "turn",
            "information gain of the turn (IGPO/A2TGPO); null = none",
            producer="The info_gain signal fills it (an InfoGainScorer stage).",
        )
    }

    mode: Mode = "prob_diff"
    """How gold-answer log-probabilities become gains: 'prob_diff' (IGPO) or
    'log_prob_diff' (IGPO's 745078b script, A2TGPO)."""
    max_batch_tokens: int = 16384
    """Padded tokens (rows x longest row) per forward pass of the scorer."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"info_gain mode must be one of {MODES}, got {self.mode!r}")
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")

    def requires(self, backend: str | None = None) -> tuple[str, ...]:
        return ("input_ids", "token_turn", "gold_answers")


SIGNALS = (InfoGain(),)
