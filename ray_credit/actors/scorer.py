"""InfoGainScorer: per-turn information gain of the gold answer under the policy that acted.

IGPO (arXiv 2510.14967) and A2TGPO (docs/estimators.md) reward a turn by
how much it raised the policy's belief in the gold answer. For trajectory ``i`` with
turns ``0..T-1`` and ``c_k`` the token context before turn ``k`` (``c_0``: the prompt;
``c_k``: the prompt plus turns ``0..k-1`` with their observations), the scorer appends a
pseudo-response that states the gold answer and measures::

    m(c) = mean over the gold's tokens g_j of  log pi(g_j | c, prefix, g_<j)
    IG_k = exp(m(c_{k+1})) - exp(m(c_k))      "prob_diff" (IGPO's default)
         = m(c_{k+1}) - m(c_k)                "log_prob_diff" (IGPO's 745078b train.sh)

for every non-final turn ``k`` (its observation is part of ``c_{k+1}``); the final turn
gets null (its reward is the outcome). ``turn_info_gain`` is float32 per turn.

Choices (and how they differ from the official code): the pseudo-response is our own
wording, ``"\\n<answer> " + gold + " </answer>"``, written after the context as is; the
gold is the first accepted answer (as in IGPO); the gold's tokens are those whose
characters overlap it when the whole pseudo-response is tokenized (745078b's offset
rule). A non-finite score (e.g. an empty gold span) leaves that turn null and is counted
in ``scorer/nonfinite``; nothing is silently set to 0. A2TGPO's copy uses a different
boundary (its first search's result is already in the baseline); that variant is not
reproduced here.

Each (trajectory, boundary) is one row of a batched forward pass, rows sorted by length
into micro-batches; only the logits of the pseudo-response positions are computed. A row
that repeats another (every trajectory of a group has the same context before its first
turn) is computed once (``scorer/rows_reused``).

The policy is the one that sampled the batch: IGPO's code scores with the rollout
policy. A pipeline sends the scorer each version once the chunks sampled with older
weights are scored, and has it score a chunk only while it holds the chunk's version
(:class:`~ray_credit.pipeline.Pipeline`'s weight targets). A batch sampled with newer
weights than the scorer's is refused (:class:`WeightsBehind`); turns sampled with older
ones are scored and counted (``scorer/turns_on_newer_weights``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from ray_credit.batch import TrajectoryBatch
from ray_credit.process_memory import PeakMeter, memory_report

__all__ = ["InfoGainScorer", "WeightsBehind", "make_scorer_actor"]

MODES = ("prob_diff", "log_prob_diff")


class WeightsBehind(RuntimeError):
    """The scorer holds older weights than a batch was sampled with (Ray restarted it on
    the base model, and the current weights have not reached it yet). ``actor_id`` names
    the scorer so that the pipeline re-sends the weights and scores the batch again."""

    def __init__(self, message: str, actor_id: str | None = None):
        super().__init__(message)
        self.actor_id = actor_id

    def __reduce__(self):
        return (WeightsBehind, (str(self), self.actor_id))


_PREFIX = "\n<answer> "
_SUFFIX = " </answer>"


class InfoGainScorer:
    """Scores ``turn_info_gain`` for a batch with the token columns (``input_ids``,
    ``token_turn``) and ``gold_answers``.

    Args:
        model: ``"smollm2-135m"``, ``"tiny-random"``, an HF id or folder, or a loaded
            ``(model, tokenizer)`` pair. It must be the policy the generator samples from;
            keep it current with :meth:`update_weights`.
        mode: ``"prob_diff"`` or ``"log_prob_diff"``.
        max_batch_tokens: padded tokens per forward pass (rows x longest row).
        autocast: None, ``"auto"``, ``"bfloat16"`` or ``"float16"``: run the forward passes
            under ``torch.autocast`` in that dtype (``"auto"``: bf16 where the device has
            it natively, else none; pipelines pass ``learner.autocast``: the
            scorer reads the policy's beliefs with the numerics the learner trains with).
    """

    def __init__(
        self,
        model: str | tuple[Any, Any] = "smollm2-135m",
        *,
        mode: str = "prob_diff",
        device: str = "cpu",
        dtype: str = "float32",
        max_batch_tokens: int = 16384,
        autocast: str | None = None,
    ):
        from ray_credit.actors.learner import check_autocast
        from ray_credit.models import load_model

        check_autocast(autocast)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        self.model, self.tokenizer = (
            model if isinstance(model, tuple) else load_model(model, dtype=dtype, device=device)
        )
        self.mode = mode
        self.max_batch_tokens = max_batch_tokens
        self.autocast = autocast
        self.policy_version = 0
        context = _actor_context()  # None outside a Ray actor
        self._restarted = bool(context and context.was_current_actor_reconstructed)
        self._memory = PeakMeter()

    def memory(self) -> dict[str, float] | None:
        """This process's resident memory and its peak since the last call (GiB)."""
        return memory_report(self._memory)

    def get_policy_version(self) -> int:
        """The version of the weights it scores with (0: the base model's)."""
        return self.policy_version

    def update_weights(self, version: int, weights: Mapping[str, Any]) -> int:
        """Adopt the policy's weights of ``version`` (versions only move forward)."""
        from ray_credit.models import load_weights_checked

        if version <= self.policy_version:
            raise ValueError(
                f"weights version {version} is not newer than the scorer's {self.policy_version}"
            )
        load_weights_checked(self.model, weights)
        self.policy_version = int(version)
        return self.policy_version

    def gold_tokens(self, gold: str) -> tuple[list[int], int, int]:
        """The pseudo-response's ids and the ``[start, stop)`` span of the gold's tokens."""
        text = _PREFIX + gold + _SUFFIX
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        lo, hi = len(_PREFIX), len(_PREFIX) + len(gold)
        inside = [j for j, (a, b) in enumerate(encoded["offset_mapping"]) if b > lo and a < hi]
        if not inside:
            return list(encoded["input_ids"]), 0, 0
        return list(encoded["input_ids"]), inside[0], inside[-1] + 1

    def score(self, batch: TrajectoryBatch) -> TrajectoryBatch:
        """A new batch with ``turn_info_gain`` (and ``scorer/*`` metrics)."""
        batch.require(("input_ids", "token_turn", "gold_answers"), by="InfoGainScorer")
        older = self._check_current(batch)
        start = time.perf_counter()
        ids_all, turns_all = batch.token_values("input_ids"), batch.token_values("token_turn")
        offsets = batch.token_offsets
        golds = batch.column("gold_answers").to_pylist()
        rows: list[tuple[list[int], int, int]] = []  # (ids, gold start, gold stop)
        owners: list[tuple[int, int]] = []  # (trajectory, boundary k)
        pseudo_cache: dict[str, tuple[list[int], int, int]] = {}
        for i, count in enumerate(batch.turn_counts):
            ids = ids_all[offsets[i] : offsets[i + 1]]
            turn = turns_all[offsets[i] : offsets[i + 1]]
            gold = golds[i][0]
            if gold not in pseudo_cache:
                pseudo_cache[gold] = self.gold_tokens(gold)
            pseudo, lo, hi = pseudo_cache[gold]
            # Boundary k: the context before turn k, k = 0..T-1 (token_turn is sorted).
            ends = np.searchsorted(turn, np.arange(int(count)), side="left")
            for k, end in enumerate(ends):
                rows.append((ids[:end].tolist() + pseudo, int(end) + lo, int(end) + hi))
                owners.append((i, k))
        scores, computed = self._mean_logprobs(rows)
        seconds = time.perf_counter() - start
        return self._with_gains(batch, owners, scores, computed, seconds, older)

    def _check_current(self, batch: TrajectoryBatch) -> int:
        """Refuse a batch sampled with newer weights than these: its gains would be read
        with another policy's beliefs (a restarted scorer is back on the base model).
        Returns how many of its turns were sampled with older weights than these (scored
        by a newer policy than the one that acted: a pipeline makes none)."""
        import pyarrow.compute as pc

        versions = batch.column("turns").flatten().field("policy_version")
        newest = pc.max(versions).as_py()
        if newest is None or newest <= self.policy_version:
            older = pc.sum(pc.less(versions, self.policy_version)).as_py()
            return int(older or 0)
        context = _actor_context()
        raise WeightsBehind(
            f"the scorer holds weights version {self.policy_version} but the batch was "
            f"sampled with version {newest}; send it the current weights (update_weights) "
            "and score again",
            actor_id=context.get_actor_id() if context else None,
        )

    def _with_gains(
        self, batch, owners, scores, computed: int, seconds: float, older: int
    ) -> TrajectoryBatch:
        per_traj: dict[int, dict[int, float]] = {}
        for (i, k), m in zip(owners, scores, strict=True):
            per_traj.setdefault(i, {})[k] = m
        gains = np.full(batch.num_turns, np.nan, dtype=np.float32)
        nonfinite = 0
        for i, count in enumerate(batch.turn_counts):
            m = per_traj[i]
            for k in range(int(count) - 1):  # the final turn has no gain
                before, after = m[k], m[k + 1]
                if self.mode == "prob_diff":
                    gain = math.exp(after) - math.exp(before)
                else:
                    gain = after - before
                if math.isfinite(gain):
                    gains[batch.turn_offsets[i] + k] = gain
                else:
                    nonfinite += 1
        valid = ~np.isnan(gains)
        column = _float_list_with_nulls(batch, gains, valid)
        metrics = {
            "scorer/forward_rows": float(computed),
            "scorer/rows_reused": float(len(owners) - computed),
            "scorer/nonfinite": float(nonfinite),
            "scorer/seconds": seconds,
            "scorer/policy_version": float(self.policy_version),
            # turns scored by a newer policy than the one that sampled them
            "scorer/turns_on_newer_weights": float(older),
            # Ray restarted this process after the last one died: said once, with the
            # first batch it scores (summed over a step's chunks: the step's restarts)
            "scorer/restarts": float(self._restarted),
        }
        self._restarted = False
        return batch.with_traj_columns({"turn_info_gain": column}, metrics=metrics)

    def _mean_logprobs(self, rows: list[tuple[list[int], int, int]]) -> tuple[list[float], int]:
        """Mean log-prob of each row's gold span, and how many rows were computed: a row
        repeated (the G trajectories of a group share the context before their first
        turn, and often their first turns) is computed once."""
        first: dict[tuple, int] = {}
        unique: list[tuple[list[int], int, int]] = []
        where = []
        for ids, lo, hi in rows:
            key = (tuple(ids), lo, hi)
            if key not in first:
                first[key] = len(unique)
                unique.append((ids, lo, hi))
            where.append(first[key])
        scores = self._mean_logprobs_batched(unique)
        return [scores[u] for u in where], len(unique)

    def _mean_logprobs_batched(self, rows: list[tuple[list[int], int, int]]) -> list[float]:
        """Mean log-prob of each row's gold span, batched by length (left padding)."""
        import torch

        from ray_credit.actors.learner import autocast

        out = [math.nan] * len(rows)
        order = sorted(range(len(rows)), key=lambda r: len(rows[r][0]))
        device = next(self.model.parameters()).device
        pad = int(self.tokenizer.pad_token_id)
        at = 0
        while at < len(order):
            stop = at + 1  # rows are sorted by length: the last one sets the padded width
            while (
                stop < len(order)
                and len(rows[order[stop]][0]) * (stop - at + 1) <= self.max_batch_tokens
            ):
                stop += 1
            chunk = order[at:stop]
            width = len(rows[chunk[-1]][0])
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for b, r in enumerate(chunk):
                seq = rows[r][0]
                ids[b, width - len(seq) :] = torch.as_tensor(seq)
                mask[b, width - len(seq) :] = 1
            # Logits only for the tail that can hold a gold span (the pseudo-responses).
            keep = max(len(rows[r][0]) - rows[r][1] for r in chunk) + 1
            keep = min(keep, width)
            with torch.inference_mode(), autocast(device, self.autocast):
                logits = self.model(
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    position_ids=(mask.cumsum(-1) - 1).clamp(min=0).to(device),
                    logits_to_keep=keep,
                ).logits.float()
            logp = torch.log_softmax(logits, dim=-1)
            for b, r in enumerate(chunk):
                seq, lo, hi = rows[r]
                if hi <= lo or lo == 0:
                    continue  # no gold token (or nothing before it): stays NaN, counted
                # Token j is predicted at position j - 1; logits cover the last `keep` positions.
                shift = width - len(seq)  # left padding
                first = shift + lo - 1 - (width - keep)
                positions = torch.arange(first, first + (hi - lo), device=logp.device)
                targets = ids[b, shift + lo : shift + hi].to(logp.device)
                out[r] = float(logp[b, positions, targets].mean())
            at = stop
        return out


def _actor_context() -> Any:
    """Ray's runtime context when this process is a Ray actor, else None."""
    try:
        import ray
    except ImportError:  # pragma: no cover - the scorer runs without Ray in tests
        return None
    if not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    return context if context.get_actor_id() else None


def _float_list_with_nulls(batch: TrajectoryBatch, values: np.ndarray, valid: np.ndarray):
    import pyarrow as pa

    flat = pa.array(values, type=pa.float32(), mask=~valid)
    offsets = pa.array(batch.turn_offsets.astype(np.int32))
    return pa.ListArray.from_arrays(offsets, flat)


def make_scorer_actor(
    *args: Any,
    num_cpus: float = 1,
    num_gpus: float = 0,
    resources: dict | None = None,
    max_restarts: int = 0,
    scheduling_strategy: Any = None,
    **kwargs: Any,
):
    """Start an :class:`InfoGainScorer` as a Ray actor; resources come from the caller.
    ``max_restarts``: how often Ray may restart it after its process dies (it comes back
    on the base weights; the pipeline re-sends the current ones and redoes the chunk)."""
    import ray

    actor = ray.remote(InfoGainScorer).options(
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        resources=resources,
        max_restarts=max_restarts,
        scheduling_strategy=scheduling_strategy,  # a placement-group bundle, or None
    )
    return actor.remote(*args, **kwargs)
