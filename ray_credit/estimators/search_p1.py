"""Search-P1: a path-centric scalar reward per trajectory, then GRPO group normalization.

Paper: "Search-P1: Path-Centric Reward Shaping for Stable and Efficient Agentic RAG
Training", arXiv 2602.22576v1, Section 3, Eq. (4), (6)-(8) and Algorithm 3; no official
code exists. The evaluator (an LLM) fills the ``sp1_*`` columns. The math and a worked
example: docs/algorithms.md, section 5.

``variant="equations"`` (default)::

    S_self  = r_planner * (n_exec / n_plan) * (n_exec / n_actions)           # Eq. (6)
    S_ref   = (n_covered / |R_ref|) * (n_covered / n_actions)                 # Eq. (7)
    R_path  = max(S_self, S_ref)
    R_out   = 1 if correct else soft_alpha * r_acc + (1 - soft_alpha) * r_reason   # Eq. (8)
    R_total = lambda_path * R_path + lambda_outcome * R_out + lambda_format * r_f   # Eq. (4)

``variant="algorithm3"``: ``s_self = r_planner * n_exec / n_plan`` and
``s_ref = n_covered / |R_ref|`` (no efficiency factors), and ``R_total = 0`` for the whole
trajectory when ``r_f = 0`` (the format gate). Then ``A_i = GRPO(R_total)`` within the
group, broadcast to every turn; ``turn_rewards`` carries ``R_total`` (diagnostic).

Derived from ``turns``: ``n_actions`` = number of ``search`` turns; valid = no
``invalid``/``truncated`` turn; has_answer = the final turn is ``answer``; has_tool_call =
some ``search`` turn; has_tool_response = some non-null ``observation``. ``r_f`` =
``format_full`` if valid and has_answer and has_tool_call, else ``format_partial`` if
has_answer and has_tool_response, else 0 (Algorithm 3). Correct = ``outcome_reward >=
correct_threshold`` (EM by default).

Defaults: lambdas 0.3 / 0.6 / 0.1 and soft_alpha 0.8 (App. B.2); r_f in {0.1, 0.05}
(Algorithm 3), so the format term is at most 0.01; GRPO knobs as verl.

Degenerate cases and departures: a zero denominator (``n_plan``, ``|R_ref|`` or
``n_actions``) makes that track 0; neither track is capped (``r_planner = 1.2``, or an
evaluator counting more executed steps than searches, gives ``S_self > 1``). When any
evaluator field is null, ``R_path := 0`` and a wrong answer's soft outcome ``:= 0``: the
trajectory keeps only the binary outcome and the format term; counted in
``search_p1/evaluator_missing``. Out-of-range evaluator values raise (the judge stage must
null them). App. B.2's Jaccard self-consistency and 0.5 partial-match decay appear nowhere
else in the paper and are not implemented.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ray_credit.batch import TrajectoryBatch, bool_values, numeric_view, valid_mask
from ray_credit.estimators._base import Estimator
from ray_credit.estimators._group import (
    GRPOKnobs,
    broadcast_to_turns,
    count_per_traj,
    equals_any,
    normalize_by_key,
)

Variant = Literal["equations", "algorithm3"]
VARIANTS = get_args(Variant)
# Evaluator fields and the values each may take (None: a count, any integer >= 0).
EVALUATOR_FIELDS: dict[str, tuple[float, ...] | None] = {
    "sp1_planner_score": (0.2, 0.6, 1.0, 1.2),
    "sp1_plan_steps": None,
    "sp1_effective_steps_self": None,
    "sp1_effective_steps_ref": None,
    "sp1_ref_plan_steps": None,
    "sp1_outcome_accuracy": (0.0, 0.5, 1.0),
    "sp1_outcome_reasoning": (0.0, 0.5, 0.8, 1.0),
}
_WEIGHTS = ("lambda_path", "lambda_outcome", "lambda_format", "format_full", "format_partial")
_BOUNDED_BY = {
    "sp1_effective_steps_self": "sp1_plan_steps",
    "sp1_effective_steps_ref": "sp1_ref_plan_steps",
}


@dataclass(frozen=True)
class SearchP1Config(GRPOKnobs):
    """Search-P1 knobs (defaults: the paper's; see the module docstring)."""

    lambda_path: float = 0.3
    """Weight of R_path in Eq. (4)."""
    lambda_outcome: float = 0.6
    """Weight of R_outcome in Eq. (4)."""
    lambda_format: float = 0.1
    """Weight of the format reward r_f in Eq. (4)."""
    soft_alpha: float = 0.8
    """Eq. (8): weight of r_acc (1 - soft_alpha on r_reason) for a wrong answer."""
    variant: Variant = "equations"
    """"equations": Eq. (4)-(8); "algorithm3": no efficiency factors, format gate."""
    format_full: float = 0.1
    """r_f for a valid trajectory with a search and an answer (Algorithm 3)."""
    format_partial: float = 0.05
    """r_f for an answer plus a tool response that misses the full condition (Algorithm 3)."""
    correct_threshold: float = 1.0
    """A trajectory is correct when outcome_reward >= this (EM by default)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in _WEIGHTS:
            value = getattr(self, name)
            if not 0 <= value < np.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not 0 <= self.soft_alpha <= 1:
            raise ValueError(
                f"soft_alpha mixes r_acc and r_reason, so it lies in [0, 1]; got {self.soft_alpha!r}"
            )
        if not np.isfinite(self.correct_threshold):
            raise ValueError(f"correct_threshold must be finite, got {self.correct_threshold!r}")


def _evaluator(batch: TrajectoryBatch) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The evaluator fields as float64 (0 where null), validated, and which rows have all."""
    values, valid = {}, {}
    for name in EVALUATOR_FIELDS:
        values[name], valid[name] = _traj_floats(batch, name)
    for name, allowed in EVALUATOR_FIELDS.items():
        x = values[name]
        if allowed is None:
            ok, what = x >= 0, "a count >= 0"  # int32 columns: integral by type
        else:
            ok, what = _is_one_of(x, allowed), f"one of {allowed}"
        _raise_on_first(batch, valid[name] & ~ok, name, x, what)
    for name, bound in _BOUNDED_BY.items():  # effective steps cannot exceed the plan they count
        bad = valid[name] & valid[bound] & (values[name] > values[bound])
        _raise_on_first(batch, bad, name, values[name], f"<= {bound} (the plan it counts)")
    return values, np.logical_and.reduce(list(valid.values()))


def _traj_floats(batch: TrajectoryBatch, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A per-trajectory numeric column as float64 with 0 where null, and its validity."""
    view, valid = numeric_view(batch.column(name))
    if view is None:
        return batch.traj_values(name, null=0).astype(np.float64), valid
    values = view.astype(np.float64)
    values[~valid] = 0.0
    return values, valid


def _is_one_of(x: np.ndarray, allowed: tuple[float, ...], atol: float = 1e-6) -> np.ndarray:
    """``|x - a| <= atol`` for some allowed ``a`` (``np.isclose`` with ``rtol=0``)."""
    ok = np.zeros(len(x), dtype=bool)
    for a in allowed:  # a handful of allowed values, each one vectorized pass
        ok |= np.abs(x - a) <= atol
    return ok


def _raise_on_first(
    batch: TrajectoryBatch, bad: np.ndarray, name: str, x: np.ndarray, what: str
) -> None:
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        traj = batch.column("traj_id")[i].as_py()
        raise ValueError(
            f"row {i} (traj_id={traj!r}): {name}={x[i]:g} is not {what}; the evaluator returned "
            "garbage, and the judge stage must store null for it instead"
        )


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """``num / den``, 0 where ``den`` is 0 (an empty plan, reference or action list)."""
    return np.divide(num, den, out=np.zeros_like(num), where=den > 0)


def _format_reward(batch: TrajectoryBatch, config: SearchP1Config) -> tuple[np.ndarray, np.ndarray]:
    """Algorithm 3's r_f per trajectory, and n_actions (the number of search turns)."""
    turns = batch.column("turns").flatten()
    action = turns.field("action")
    if action.null_count:
        k = int(np.flatnonzero(~action.is_valid().to_numpy(zero_copy_only=False))[0])
        traj = batch.column("traj_id")[int(batch.turn_traj_index[k])].as_py()
        raise ValueError(
            f"traj_id={traj!r}: a turn has no action; search_p1 derives n_actions "
            "and the format reward from turns.action"
        )
    n_actions = count_per_traj(batch, _equals(action, "search"))
    valid = count_per_traj(batch, equals_any(action, "invalid", "truncated")) == 0
    has_answer = _equals(action.take(pa.array(batch.turn_offsets[1:] - 1)), "answer")
    has_response = count_per_traj(batch, valid_mask(turns.field("observation"))) > 0
    full = valid & has_answer & (n_actions > 0)
    r_f = np.where(
        full, config.format_full, np.where(has_answer & has_response, config.format_partial, 0.0)
    )
    return r_f, n_actions


def _equals(strings: pa.Array, target: str) -> np.ndarray:
    """Numpy mask over ``strings``: the string is ``target`` (null: False)."""
    hit = pc.equal(strings, target)
    return bool_values(hit, null=False)


def path_centric_reward(batch: TrajectoryBatch, config: SearchP1Config) -> dict[str, np.ndarray]:
    """Per-trajectory parts of the Search-P1 reward: ``self``, ``ref``, ``path``,
    ``outcome``, ``format``, ``total`` (float64) and ``missing`` (bool, evaluator null)."""
    ev, present = _evaluator(batch)
    r_f, n_actions = _format_reward(batch, config)
    n_exec, n_cov = ev["sp1_effective_steps_self"], ev["sp1_effective_steps_ref"]
    s_self = ev["sp1_planner_score"] * _ratio(n_exec, ev["sp1_plan_steps"])
    s_ref = _ratio(n_cov, ev["sp1_ref_plan_steps"])
    if config.variant == "equations":
        s_self = s_self * _ratio(n_exec, n_actions)  # Eq. (6)
        s_ref = s_ref * _ratio(n_cov, n_actions)  # Eq. (7)
    path = np.where(present, np.maximum(s_self, s_ref), 0.0)  # R_path := 0 without an evaluator
    correct = batch.traj_values("outcome_reward") >= config.correct_threshold
    alpha = config.soft_alpha
    soft = alpha * ev["sp1_outcome_accuracy"] + (1 - alpha) * ev["sp1_outcome_reasoning"]
    outcome = np.where(correct, 1.0, np.where(present, soft, 0.0))  # Eq. (8)
    total = (
        config.lambda_path * path + config.lambda_outcome * outcome + config.lambda_format * r_f
    )  # Eq. (4)
    if config.variant == "algorithm3":
        total = np.where(r_f > 0, total, 0.0)  # Algorithm 3: no format, no reward
    parts = {"self": s_self, "ref": s_ref, "path": path, "outcome": outcome, "format": r_f}
    return {**parts, "total": total, "missing": ~present}


def search_p1(batch: TrajectoryBatch, config: SearchP1Config) -> TrajectoryBatch:
    parts = path_centric_reward(batch, config)
    advantage = normalize_by_key(
        parts["total"], batch.group_index, batch.num_groups, config.norm_spec()
    )
    metrics = {
        "search_p1/evaluator_missing": float(parts["missing"].sum()),
        "search_p1/format_zero": float((parts["format"] == 0).sum()),
        "search_p1/path_mean": float(parts["path"].mean()),
        "search_p1/reward_mean": float(parts["total"].mean()),
    }
    # One value per trajectory, repeated on its turns in the columns' storage type (float32).
    return batch.with_turn_columns(
        {
            "turn_rewards": broadcast_to_turns(batch, parts["total"].astype(np.float32)),
            "turn_advantages": broadcast_to_turns(batch, advantage.astype(np.float32)),
        },
        metrics=metrics,
    )


def search_p1_composition(config: SearchP1Config) -> str:
    from ray_credit.estimators.grpo import group_text

    names = ("lambda_path", "lambda_outcome", "lambda_format", "soft_alpha", "variant",
             "format_full", "format_partial", "correct_threshold")  # fmt: skip
    path = ", ".join(f"{name}={getattr(config, name)!r}" for name in names)
    return f"path({path}) | {group_text(config)}"


ESTIMATORS = (
    Estimator(
        "search_p1",
        search_p1,
        SearchP1Config,
        ("group_id", "outcome_reward", "turns", *EVALUATOR_FIELDS),
        "path-centric reward (plan execution, reference coverage, soft outcome) + GRPO (Search-P1)",
        signals={"search_p1_evaluation": {}},
        # the paper's recipe: clip 0.2 to 0.28 (DAPO's clip-higher), low-var KL loss 0.001
        learner={"loss.clip_high": 0.28, "kl_coef": 1e-3},
        composition=search_p1_composition,
    ),
)
