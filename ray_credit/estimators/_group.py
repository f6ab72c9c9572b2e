"""Vectorized group and turn operations shared by the estimators.

Everything here works on flat numpy arrays plus integer keys (a group code, or a
composite (group, turn) code), so an estimator never loops over groups in Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ray_credit.batch import TrajectoryBatch

SINGLETON_POLICIES = ("zero_mean_unit_std", "center")


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
    singleton: str = "zero_mean_unit_std"
    var_eps: float = 0.0

    def __post_init__(self) -> None:
        check_norm_params(std_ddof=self.ddof, eps=self.eps, singleton_policy=self.singleton)
        if self.var_eps < 0:
            raise ValueError(f"var_eps must be >= 0, got {self.var_eps}")


def check_norm_params(*, std_ddof: int, eps: float, singleton_policy: str = "center") -> None:
    """Validate the fidelity knobs every estimator shares (raises ValueError)."""
    if std_ddof not in (0, 1):
        raise ValueError(f"std_ddof must be 0 (population) or 1 (sample), got {std_ddof!r}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    if singleton_policy not in SINGLETON_POLICIES:
        raise ValueError(
            f"singleton_policy must be one of {SINGLETON_POLICIES}, got {singleton_policy!r}"
        )


def key_stats(
    values: np.ndarray, keys: np.ndarray, num_keys: int, *, ddof: int, var_eps: float = 0.0
):
    """Per-key ``(count, mean, std)``; std is 0 where the count is too small for ``ddof``.

    Two-pass (mean first, then squared deviations) so an all-equal key has std exactly 0.
    """
    count = np.bincount(keys, minlength=num_keys).astype(np.float64)
    total = np.bincount(keys, weights=values, minlength=num_keys)
    mean = np.divide(total, count, out=np.zeros(num_keys), where=count > 0)
    deviation = values - mean[keys]
    sq = np.bincount(keys, weights=deviation * deviation, minlength=num_keys)
    dof = count - ddof
    var = np.divide(sq, dof, out=np.zeros(num_keys), where=dof > 0)
    return count, mean, np.sqrt(var + var_eps)


def normalize_by_key(
    values: np.ndarray, keys: np.ndarray, num_keys: int, spec: NormSpec
) -> np.ndarray:
    """Normalize ``values`` within each key following ``spec`` (see :class:`NormSpec`)."""
    values = np.asarray(values, dtype=np.float64)
    count, mean, std = key_stats(values, keys, num_keys, ddof=spec.ddof, var_eps=spec.var_eps)
    single = count <= 1
    if spec.singleton == "zero_mean_unit_std":
        mean = np.where(single, 0.0, mean)
    # "center" keeps mean = the value itself, so a singleton normalizes to 0.
    centered = values - mean[keys]
    if not spec.norm_by_std:
        return centered
    std = np.where(single, 1.0, std)
    return centered / (std[keys] + spec.eps)


def broadcast_to_turns(batch: TrajectoryBatch, per_traj: np.ndarray) -> np.ndarray:
    """Repeat one value per trajectory onto each of its turns (flat turn order)."""
    return np.repeat(per_traj, batch.turn_counts)


def turn_mask(batch: TrajectoryBatch) -> np.ndarray:
    """``(n_traj, max_turns)`` boolean matrix, True where the turn exists.

    Row-major order of its True cells is the flat turn order, so ``dense[mask]`` is the
    flat view of a dense matrix and ``dense[mask] = flat`` fills one.
    """
    width = int(batch.turn_counts.max())
    return np.arange(width)[None, :] < batch.turn_counts[:, None]


def to_dense(
    batch: TrajectoryBatch, flat: np.ndarray, fill: float | np.ndarray = 0.0
) -> np.ndarray:
    """Flat per-turn values as an ``(n_traj, max_turns)`` float64 matrix.

    ``fill`` (a scalar or one value per trajectory) goes where a trajectory has no turn.
    """
    n, width = len(batch), int(batch.turn_counts.max())
    fill = np.asarray(fill, dtype=np.float64)
    dense = np.empty((n, width))
    dense[...] = fill[:, None] if fill.ndim else fill
    dense[turn_mask(batch)] = flat
    return dense


def from_dense(batch: TrajectoryBatch, dense: np.ndarray) -> np.ndarray:
    """The existing turns of a dense matrix, back in flat turn order."""
    return dense[turn_mask(batch)]


def column_normalize(
    batch: TrajectoryBatch, dense: np.ndarray, counted: np.ndarray, spec: NormSpec
) -> np.ndarray:
    """Normalize each column of an ``(n_traj, width)`` matrix within each prompt group.

    Cell ``(i, k)`` is normalized against the counted cells of column ``k`` of its group
    (``counted`` is a boolean matrix of the same shape); uncounted cells come back 0.
    Groups are reduced as contiguous row blocks, never through per-cell key lookups.
    """
    order = batch.group_order
    values = dense if order is None else dense[order]
    weight = (counted if order is None else counted[order]).astype(np.float64)
    sizes = batch.group_sizes
    if (sizes == sizes[0]).all():
        # Equal-size groups (the usual case): a (groups, size, width) view, broadcasting.
        shape = (len(sizes), int(sizes[0]), values.shape[1])
        normalized = _normalize_blocks(values.reshape(shape), weight.reshape(shape), spec)
        normalized = normalized.reshape(values.shape)
    else:
        # Ragged groups: pad each group to the largest with uncounted rows.
        rows = np.arange(len(values)) - np.repeat(batch.group_starts, sizes)
        shape = (len(sizes), int(sizes.max()), values.shape[1])
        block_values, block_weight = np.zeros(shape), np.zeros(shape)
        block_values[np.repeat(np.arange(len(sizes)), sizes), rows] = values
        block_weight[np.repeat(np.arange(len(sizes)), sizes), rows] = weight
        normalized = _normalize_blocks(block_values, block_weight, spec)
        normalized = normalized[np.repeat(np.arange(len(sizes)), sizes), rows]
    if order is None:
        return normalized
    out = np.empty_like(normalized)
    out[order] = normalized
    return out


def _normalize_blocks(values: np.ndarray, weight: np.ndarray, spec: NormSpec) -> np.ndarray:
    """:func:`column_normalize` on ``(groups, rows, width)`` blocks with 0/1 weights."""

    def sum_rows(x: np.ndarray) -> np.ndarray:
        # A loop over the rows of a block (the group size), not over groups: summing
        # strided slices is several times faster than a reduction over the middle axis.
        total = x[:, 0].copy()
        for j in range(1, x.shape[1]):
            total += x[:, j]
        return total

    values = values * weight
    count = sum_rows(weight)
    mean = np.divide(sum_rows(values), count, out=np.zeros(count.shape), where=count > 0)
    deviation = (values - mean[:, None]) * weight
    dof = count - spec.ddof
    var = np.divide(sum_rows(deviation * deviation), dof, out=np.zeros(dof.shape), where=dof > 0)
    single = count <= 1
    if spec.singleton == "zero_mean_unit_std":
        deviation = (values - np.where(single, 0.0, mean)[:, None]) * weight
    if spec.norm_by_std:
        deviation /= (np.where(single, 1.0, np.sqrt(var + spec.var_eps)) + spec.eps)[:, None]
    return deviation


def discounted_reverse_sum(dense: np.ndarray, gamma: float) -> np.ndarray:
    """``out[:, k] = x[:, k] + gamma * out[:, k+1]`` along the turn axis.

    Cells past a trajectory's last turn must hold 0 so they add nothing.
    """
    out = np.array(dense, dtype=np.float64, copy=True)
    for k in range(out.shape[1] - 2, -1, -1):
        out[:, k] += gamma * out[:, k + 1]
    return out


def grpo_advantage(
    batch: TrajectoryBatch, spec: NormSpec, column: str = "outcome_reward"
) -> np.ndarray:
    """GRPO outcome advantage per trajectory: ``column`` normalized within its group."""
    rewards = batch.traj_values(column).astype(np.float64)
    return normalize_by_key(rewards, batch.group_index, batch.num_groups, spec)


def group_all(flags: np.ndarray, group_index: np.ndarray, num_groups: int) -> np.ndarray:
    """Per group: True when ``flags`` is True for every member."""
    misses = np.bincount(group_index, weights=~flags, minlength=num_groups)
    return misses == 0
