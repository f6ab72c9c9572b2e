"""Vectorized group and turn operations shared by the estimators.

Everything here works on flat numpy arrays plus integer keys (a group code, or a
composite (group, turn) code), so an estimator never loops over groups in Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ray_credit.batch import TrajectoryBatch, bool_values, numeric_view
from ray_credit.config import check_fields

SingletonPolicy = Literal["zero_mean_unit_std", "center"]
SINGLETON_POLICIES = get_args(SingletonPolicy)


@dataclass(frozen=True)
class NormSpec:
    """How a set of values is normalized within its key (group).

    ``A = (x - mean) / (std + eps)`` with ``std = sqrt(var + var_eps)``, ``var`` the
    variance with ``ddof`` (0 population, 1 sample). ``norm_by_std=False`` gives
    ``A = x - mean`` (Dr.GRPO). A key with one member follows ``singleton``:
    ``"zero_mean_unit_std"`` (verl GRPO: mean 0, std 1, so ``A = x / (1 + eps)``) or
    ``"center"`` (IGPO, GiGPO step groups: mean x, std 1, so ``A = 0``).
    """

    ddof: int = 1
    eps: float = 1e-6
    norm_by_std: bool = True
    singleton: SingletonPolicy = "zero_mean_unit_std"
    var_eps: float = 0.0

    def __post_init__(self) -> None:
        check_fields(self)
        check_norm_params(std_ddof=self.ddof, eps=self.eps, singleton_policy=self.singleton)
        check_var_eps(self.var_eps)


@dataclass(frozen=True)
class GRPOKnobs:
    """GRPO's outcome-normalization knobs with verl's defaults, for configs to inherit."""

    eps: float = 1e-6
    """Added to the std in the denominator."""
    std_ddof: int = 1
    """1: sample std (verl, Search-R1, torch.std); 0: population std."""
    norm_by_std: bool = True
    """False: mean-only centering, A = r - mean (Dr.GRPO)."""
    singleton_policy: SingletonPolicy = "zero_mean_unit_std"
    """One-member group: "zero_mean_unit_std" (verl, A = r/(1+eps)) or "center" (A = 0)."""

    def __post_init__(self) -> None:
        check_fields(self)
        check_norm_params(
            std_ddof=self.std_ddof, eps=self.eps, singleton_policy=self.singleton_policy
        )

    def norm_spec(self) -> NormSpec:
        return NormSpec(
            ddof=self.std_ddof,
            eps=self.eps,
            norm_by_std=self.norm_by_std,
            singleton=self.singleton_policy,
        )


def check_norm_params(
    *, std_ddof: int = 0, eps: float | None = None, singleton_policy: str = "center"
) -> None:
    """Validate the fidelity knobs every estimator shares (raises ValueError; the config's
    :func:`~ray_credit.config.check_fields` has refused values of the wrong type first).

    ``eps`` (None: the caller has none) must be finite and > 0: it keeps the division of
    an all-equal group, 0 / (0 + eps), at 0, and an infinite eps zeroes every advantage.
    """
    if std_ddof not in (0, 1):
        raise ValueError(f"std_ddof must be 0 (population) or 1 (sample), got {std_ddof!r}")
    if eps is not None and not 0 < eps < math.inf:
        raise ValueError(
            f"eps must be a finite number > 0 (it is added to the std so that an all-equal "
            f"group divides 0 by eps, not by 0), got {eps!r}; verl uses 1e-6"
        )
    if singleton_policy not in SINGLETON_POLICIES:
        raise ValueError(
            f"singleton_policy must be one of {SINGLETON_POLICIES}, got {singleton_policy!r}"
        )


def check_var_eps(var_eps: float) -> None:
    """``var_eps`` (added to the variance under the square root) is finite and >= 0."""
    if not 0 <= var_eps < math.inf:
        raise ValueError(
            f"var_eps must be a finite number >= 0 (an infinite one zeroes every "
            f"advantage), got {var_eps!r}"
        )


def key_stats(
    values: np.ndarray,
    keys: np.ndarray,
    num_keys: int,
    *,
    ddof: int,
    var_eps: float = 0.0,
    weights: np.ndarray | None = None,
):
    """Per-key ``(count, mean, std)``; std is 0 where the count is too small for ``ddof``.

    ``weights[i]`` (default 1) says how many equal values ``values[i]`` stands for.
    Two-pass (mean first, then squared deviations) so an all-equal key has std exactly 0.
    """
    w = None if weights is None else np.asarray(weights, dtype=np.float64)
    count = np.bincount(keys, weights=w, minlength=num_keys).astype(np.float64, copy=False)
    total = np.bincount(keys, weights=values if w is None else w * values, minlength=num_keys)
    mean = np.divide(total, count, out=np.zeros(num_keys), where=count > 0)
    sq = (values - mean[keys]) ** 2
    sq = np.bincount(keys, weights=sq if w is None else w * sq, minlength=num_keys)
    dof = count - ddof
    var = np.divide(sq, dof, out=np.zeros(num_keys), where=dof > 0)
    return count, mean, np.sqrt(var + var_eps)


def _block_size(batch: TrajectoryBatch) -> int | None:
    """G when every prompt group is one contiguous run of G rows (a generator's layout,
    so per-group work is a reshape to ``(groups, G)``); None otherwise."""
    sizes = batch.group_sizes
    if batch.group_order is None and (sizes == sizes[0]).all():
        return int(sizes[0])
    return None


def normalize_by_key(
    values: np.ndarray, keys: np.ndarray, num_keys: int, spec: NormSpec
) -> np.ndarray:
    """Normalize ``values`` within each key following ``spec`` (see :class:`NormSpec`)."""
    return normalize_where(np.asarray(values, dtype=np.float64), keys, num_keys, spec)[0]


def broadcast_to_turns(batch: TrajectoryBatch, per_traj: np.ndarray) -> np.ndarray:
    """Repeat one value per trajectory onto each of its turns (flat turn order)."""
    return np.repeat(per_traj, batch.turn_counts)


def grpo_advantage(
    batch: TrajectoryBatch, spec: NormSpec, column: str = "outcome_reward"
) -> np.ndarray:
    """GRPO outcome advantage per trajectory: ``column`` normalized within its group."""
    return group_normalize(batch, batch.traj_values(column).astype(np.float64), spec)


def group_stats(batch: TrajectoryBatch, per_traj: np.ndarray, *, ddof: int):
    """Per prompt group ``(count, mean, std)`` of one value per trajectory (std 0 when
    the count is too small for ``ddof``); a reshape when groups are contiguous runs of
    one size, keys otherwise."""
    size = _block_size(batch)
    if size is None or size <= ddof:
        return key_stats(per_traj, batch.group_index, batch.num_groups, ddof=ddof)
    block = per_traj.reshape(-1, size)
    return batch.group_sizes.astype(np.float64), block.mean(axis=1), block.std(axis=1, ddof=ddof)


def group_normalize(batch: TrajectoryBatch, per_traj: np.ndarray, spec: NormSpec) -> np.ndarray:
    """One value per trajectory, normalized within its prompt group (see :class:`NormSpec`).

    When the groups are contiguous runs of one size (a generator's G samples in a row,
    the usual layout) this is a reshape to ``(groups, G)``; otherwise it goes by keys.
    """
    size = _block_size(batch)
    if size is None or size == 1:
        return normalize_by_key(per_traj, batch.group_index, batch.num_groups, spec)
    block = per_traj.reshape(-1, size)
    mean = block.mean(axis=1, keepdims=True)
    centered = block - mean
    if spec.norm_by_std:
        var = np.square(centered).sum(axis=1, keepdims=True) / (size - spec.ddof)
        centered /= np.sqrt(var + spec.var_eps) + spec.eps
    return centered.ravel()


def group_all(batch: TrajectoryBatch, flags: np.ndarray) -> np.ndarray:
    """Per prompt group: True when ``flags`` (one per trajectory) is True for every member."""
    size = _block_size(batch)
    if size is not None:
        return flags.reshape(-1, size).all(axis=1)
    return np.bincount(batch.group_index, weights=~flags, minlength=batch.num_groups) == 0


def normalize_where(
    values: np.ndarray,
    keys: np.ndarray,
    num_keys: int,
    spec: NormSpec,
    mask: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`normalize_by_key` of the entries where ``mask`` holds (0 elsewhere), and the
    number of such entries per key.

    ``values`` (float64 or float32: the arithmetic is float64) must be 0 where ``mask``
    is False. Equal to normalizing the masked subset (a masked-out entry adds 0 to every
    sum, which runs in index order as in the loop references) without copying it out;
    ``mask=None`` takes every entry.
    """
    count = np.bincount(keys, minlength=num_keys)
    if mask is not None:  # minus the masked-out entries (usually few)
        count -= np.bincount(keys[~mask], minlength=num_keys)
    mean = np.bincount(keys, weights=values, minlength=num_keys).astype(np.float64, copy=False)
    np.divide(mean, count, out=mean, where=count > 0)  # an empty key keeps its sum, 0
    out = mean[keys]
    np.subtract(values, out, out=out)
    if mask is not None:
        out *= mask
    scratch = np.square(out)  # one per-entry buffer, reused below (mode="clip": unbuffered)
    std = np.bincount(keys, weights=scratch, minlength=num_keys).astype(np.float64, copy=False)
    # count <= ddof: at most one entry, whose squared deviation (the sum kept) is 0.
    np.divide(std, count - spec.ddof, out=std, where=count > spec.ddof)
    std += spec.var_eps
    np.sqrt(std, out=std)
    single = count <= 1
    if spec.singleton == "zero_mean_unit_std" and single.any():  # singleton: mean 0
        np.subtract(
            values, np.take(np.where(single, 0.0, mean), keys, out=scratch, mode="clip"), out=out
        )
        if mask is not None:
            out *= mask
    if spec.norm_by_std:
        out /= np.take(np.where(single, 1.0, std) + spec.eps, keys, out=scratch, mode="clip")
    return out, count


def reverse_discounted_sum(
    values: np.ndarray, lengths: np.ndarray, gamma: float, *, skip_zeros: bool = False
) -> np.ndarray:
    """``out[k] = values[k] + gamma * out[k+1]`` within consecutive segments, in place.

    ``values`` holds segments of ``lengths`` back to back (flat turns: the trajectories).
    ``skip_zeros=True`` (IGPO's official boundary rule) treats a 0 entry as no turn:
    ``out[k] = out[k+1]``. Runs backwards from every segment's end at once: step ``d``
    updates the entries ``d`` before their segment's end, in segments longer than ``d``.
    """
    _, last, longer = segments_longest_first(lengths)
    after = values[last[: longer[1]]] if len(longer) > 2 else None
    for d in range(1, len(longer) - 1):
        at = last[: longer[d]] - d
        after = after[: longer[d]]  # out[k+1]: the previous step, segments longest first
        current = values[at]
        step = current + gamma * after
        if skip_zeros:
            step = np.where(current != 0, step, after)
        values[at] = after = step
    return values


def next_marked(marked: np.ndarray) -> np.ndarray:
    """For each flat index, the first index at or after it where ``marked`` holds (the
    last entry of every segment must be marked, so the answer stays in its segment)."""
    n = len(marked)
    at = np.where(marked, np.arange(n), n)
    return np.minimum.accumulate(at[::-1])[::-1]


def segments_longest_first(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Segments of ``lengths`` (back to back) ordered longest first: ``(order, last,
    longer)``, with ``last`` the flat index of each ordered segment's last entry and
    ``longer[d]`` the number of segments longer than ``d``, so those are ``order[:longer[d]]``.
    """
    top = int(lengths.max(initial=0))
    order = np.argsort((top - lengths).astype(np.min_scalar_type(top)), kind="stable")  # radix
    last = (np.cumsum(lengths) - 1)[order]
    longer = len(lengths) - np.cumsum(np.bincount(lengths, minlength=top + 1))
    return order, last, longer


def equals_any(strings: pa.Array, *targets: str) -> np.ndarray:
    """Numpy mask over ``strings``: the string is one of ``targets`` (null: False), for
    rare targets (actions such as ``invalid``).

    Only strings of a target's byte length can match; when those are a minority, only
    they go through Arrow's string comparison.
    """
    lengths, valid = numeric_view(pc.binary_length(strings))
    maybe = valid & np.logical_or.reduce([lengths == len(t.encode()) for t in targets])
    if 2 * np.count_nonzero(maybe) >= len(strings):
        hit = pc.is_in(strings, pa.array(targets))  # never null
        return bool_values(hit)
    subset = np.flatnonzero(maybe)
    out = np.zeros(len(strings), dtype=bool)
    out[subset] = bool_values(pc.is_in(strings.take(pa.array(subset)), pa.array(targets)))
    return out


def count_per_traj(batch: TrajectoryBatch, flags: np.ndarray) -> np.ndarray:
    """Number of True ``flags`` (one per flat turn) in each trajectory, as float64."""
    if not flags.any():  # e.g. no invalid action, no tool response: skip the scan
        return np.zeros(len(batch))
    seen = np.zeros(batch.num_turns + 1, dtype=np.int32 if batch.num_turns < 2**31 else np.int64)
    np.cumsum(flags, out=seen[1:])
    offsets = batch.turn_offsets
    return (seen[offsets[1:]] - seen[offsets[:-1]]).astype(np.float64)
