"""Batch builders and helpers for tests, benchmarks and examples.

:func:`make_batch` states a small case in a few lines; :func:`random_batch` builds a large
random batch straight from numpy (ragged turns, singleton groups, all-equal groups,
all-wrong groups, null signals), so it costs milliseconds even at bench scale.
:func:`process_group_of_one` runs DDP or FSDP2 over a single rank in this process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from ray_credit.batch import COLUMNS, TURN_STRUCT, TrajectoryBatch

__all__ = [
    "PadOnlyTokenizer",
    "make_batch",
    "max_logprob_gap",
    "process_group_of_one",
    "random_batch",
]


def make_batch(rows: Sequence[Mapping[str, Any]]) -> TrajectoryBatch:
    """Build a batch from terse rows.

    Each row has ``group`` (default ``"g0"``), ``reward`` (the outcome) and either
    ``turns`` (a number of turns: searches then a final answer) or ``actions`` (a list of
    action names); any other key is a column of that name (turn-aligned lists included)::

        make_batch([
            {"group": "q1", "reward": 1.0, "turns": 3, "turn_contains_gold": [0, 1, 0]},
            {"group": "q1", "reward": 0.0, "turns": 2, "turn_contains_gold": [0, 0]},
        ])
    """
    records = []
    for i, row in enumerate(rows):
        row = dict(row)
        actions = row.pop("actions", None)
        if actions is None:
            n = int(row.pop("turns", 1))
            actions = ["search"] * (n - 1) + ["answer"]
        else:
            row.pop("turns", None)
        group = row.pop("group", "g0")
        record = {
            "group_id": str(group),
            "traj_id": row.pop("traj_id", f"t{i}"),
            "question": row.pop("question", f"question of {group}?"),
            "gold_answers": row.pop("gold_answers", ["gold"]),
            "turns": [{"action": a, "policy_version": 0} for a in actions],
            "outcome_reward": float(row.pop("reward", 0.0)),
        }
        for name, value in row.items():
            spec = COLUMNS.get(name)
            if spec is not None and spec.align == "turn" and value is not None:
                value = [None if v is None else _as_value(v, spec.type.value_type) for v in value]
            record[name] = value
        records.append(record)
    return TrajectoryBatch.from_records(records)


def _as_value(v: Any, type_: pa.DataType) -> Any:
    if pa.types.is_boolean(type_):
        return bool(v)
    if pa.types.is_integer(type_):
        return int(v)
    return float(v)


def random_batch(
    rng: np.random.Generator | int,
    *,
    num_groups: int = 16,
    group_size: int = 8,
    max_turns: int = 8,
    singleton_frac: float = 0.1,
    null_frac: float = 0.05,
    binary_reward: bool = True,
    id_prefix: str = "",
    policy_version: int = 0,
    prompt_tokens: int = 0,
    tokens_per_turn: int = 0,
    vocab_size: int = 32_000,
) -> TrajectoryBatch:
    """A random batch with every signal column an estimator may read.

    Groups come in four kinds, drawn uniformly: all-wrong, all-correct, mixed, and
    all-equal in every signal; a ``singleton_frac`` share has one trajectory. Turn counts
    are uniform in ``[1, max_turns]``. Signals are null at rate ``null_frac``.

    ``id_prefix`` starts every group and trajectory id (batches that will be concatenated
    need different ones); every turn carries ``policy_version``. With ``tokens_per_turn >
    0`` the batch also has the learner's token columns: ``prompt_tokens`` prompt tokens,
    then ``tokens_per_turn`` per turn, the first half generated and the rest observation,
    token ids below ``vocab_size``.
    """
    rng = np.random.default_rng(rng)
    sizes = np.where(rng.random(num_groups) < singleton_frac, 1, group_size)
    n = int(sizes.sum())
    group = np.repeat(np.arange(num_groups), sizes)
    kind = rng.integers(0, 4, num_groups)[group]  # 0 wrong, 1 correct, 2 mixed, 3 all-equal
    turns = rng.integers(1, max_turns + 1, n)
    if binary_reward:
        reward = np.select([kind == 0, kind == 1], [0.0, 1.0], rng.integers(0, 2, n).astype(float))
    else:
        reward = np.select([kind == 0], [0.0], rng.random(n).round(2))
    equal = kind == 3
    turns = np.where(equal, max(1, max_turns // 2), turns)
    reward = np.where(equal, 0.0, reward)
    t = int(turns.sum())
    traj_of_turn = np.repeat(np.arange(n), turns)
    offsets = np.concatenate(([0], np.cumsum(turns))).astype(np.int32)
    position = np.arange(t) - offsets[:-1][traj_of_turn]
    last = position == turns[traj_of_turn] - 1
    eq_turn = equal[traj_of_turn]

    def nulls(size: int) -> np.ndarray:
        return rng.random(size) < null_frac

    def turn_list(
        values: np.ndarray, type_: pa.DataType, mask: np.ndarray | None = None
    ) -> pa.Array:
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=type_, mask=mask))

    contains = np.where(eq_turn, False, rng.random(t) < 0.25)
    utility = np.where(eq_turn, 1, rng.integers(0, 2, t)).astype(np.int8)
    correct = np.where(eq_turn, 1, rng.integers(0, 2, t)).astype(np.int8)
    info_gain = np.where(eq_turn, 0.1, rng.normal(0, 0.2, t)).astype(np.float32)
    action = np.where(last, "answer", "search")
    planner = rng.choice(np.array([0.2, 0.6, 1.0, 1.2], np.float32), n)
    plan_steps = rng.integers(1, 5, n).astype(np.int32)
    ref_steps = rng.integers(1, 5, n).astype(np.int32)

    struct = pa.StructArray.from_arrays(
        [
            pa.array(np.full(t, ""), pa.string()),
            pa.array(action, pa.string()),
            pa.nulls(t, pa.string()),
            pa.nulls(t, pa.string()),
            pa.array(np.full(t, policy_version, np.int64)),
        ],
        fields=list(TURN_STRUCT),
    )
    ids = np.arange(n).astype(str)
    columns = {
        "group_id": pa.array(np.char.add(id_prefix + "g", group.astype(str))),
        "traj_id": pa.array(np.char.add(id_prefix + "t", ids)),
        "question": pa.array(np.char.add("q", group.astype(str))),
        "gold_answers": pa.ListArray.from_arrays(
            pa.array(np.arange(n + 1, dtype=np.int32)), pa.array(np.full(n, "gold"))
        ),
        "turns": pa.ListArray.from_arrays(pa.array(offsets), struct),
        "outcome_reward": pa.array(reward, pa.float64()),
        "turn_contains_gold": turn_list(contains, pa.bool_(), nulls(t) & ~eq_turn),
        "judge_utility": turn_list(utility, pa.int8(), nulls(t) & ~eq_turn),
        "judge_correct": turn_list(correct, pa.int8(), nulls(t) & ~eq_turn),
        "turn_info_gain": turn_list(info_gain, pa.float32(), last | (nulls(t) & ~eq_turn)),
        "sp1_planner_score": pa.array(planner, mask=nulls(n) & ~equal),
        "sp1_plan_steps": pa.array(plan_steps),
        "sp1_effective_steps_self": pa.array(
            np.minimum(rng.integers(0, 5, n), plan_steps).astype(np.int32)
        ),
        "sp1_effective_steps_ref": pa.array(
            np.minimum(rng.integers(0, 5, n), ref_steps).astype(np.int32)
        ),
        "sp1_ref_plan_steps": pa.array(ref_steps),
        "sp1_outcome_accuracy": pa.array(rng.choice(np.array([0, 0.5, 1], np.float32), n)),
        "sp1_outcome_reasoning": pa.array(rng.choice(np.array([0, 0.5, 0.8, 1], np.float32), n)),
    }
    if tokens_per_turn > 0:
        columns.update(_token_columns(rng, turns, prompt_tokens, tokens_per_turn, vocab_size))
    return TrajectoryBatch.from_table(pa.table(columns))


def _token_columns(
    rng: np.random.Generator, turns: np.ndarray, prompt: int, per_turn: int, vocab: int
) -> dict[str, pa.Array]:
    lengths = prompt + turns * per_turn
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    owner = np.repeat(np.arange(len(turns)), lengths)
    within = np.arange(offsets[-1]) - offsets[:-1][owner] - prompt
    turn = np.where(within < 0, -1, within // per_turn).astype(np.int16)
    generated = (within >= 0) & (within % per_turn < (per_turn + 1) // 2)
    logprobs = np.where(generated, -rng.exponential(1.0, len(owner)), 0.0).astype(np.float32)

    def tokens(values: np.ndarray) -> pa.Array:
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))

    return {
        "input_ids": tokens(rng.integers(0, vocab, len(owner), dtype=np.int32)),
        "loss_mask": tokens(generated.astype(np.int8)),
        "token_turn": tokens(turn),
        "behavior_logprobs": tokens(logprobs),
    }


def max_logprob_gap(model: Any, batch: TrajectoryBatch) -> float:
    """The largest |behaviour log-prob - teacher-forced log-prob| over the sampled tokens
    of ``batch`` (``loss_mask`` 1), the forward pass of ``model`` (a causal LM, float32
    log-softmax) on its device: how exactly a generator's log-probs are the policy's."""
    import torch

    device = next(model.parameters()).device
    worst = 0.0
    for row in batch.to_records():
        ids = torch.tensor(row["input_ids"], device=device)[None]
        with torch.inference_mode():
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        forced = logp[:-1].gather(-1, ids[0, 1:, None])[:, 0].cpu().numpy()
        mask = np.array(row["loss_mask"][1:]) == 1
        behavior = np.array(row["behavior_logprobs"][1:])
        if mask.any():
            worst = max(worst, float(np.abs(forced[mask] - behavior[mask]).max()))
    return worst


@contextlib.contextmanager
def process_group_of_one(backend: str = "gloo") -> Iterator[None]:
    """A torch.distributed process group of this process alone (``"gloo"`` on CPUs,
    ``"nccl"`` on a GPU), destroyed on exit: the learner's DDP and FSDP2 hooks
    (:class:`~ray_credit.actors.learner.TorchFSDP`) then run as each rank of a learner
    group runs them, without Ray."""
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized in this process")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class PadOnlyTokenizer:
    """The tokenizer of a learner trained on random token ids: its update reads only the
    pad id."""

    pad_token_id = 0
