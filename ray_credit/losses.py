"""Policy-gradient losses, loss aggregation, KL penalties and entropy (torch).

Every function here is pure: tensors in, tensors out, no module state. Per-token tensors are
shaped ``(B, L)`` (batch rows, response positions); ``mask`` is 0/1 (float or bool) and marks
the tokens the policy generated (tool observations and padding are 0).

Semantics follow verl's ``core_algos.py`` (``compute_policy_loss_vanilla``, ``agg_loss``,
``kl_penalty``) and, for the turn-level ratio with adaptive clipping, A2TGPO's
``compute_policy_loss_gspo_turn``; the unit tests check hand-computed vectors of each.
The equations, with worked examples: docs/algorithms.md, section 9.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple, get_args

import torch
from torch import Tensor

from ray_credit.config import check_fields

__all__ = [
    "AGG_MODES",
    "KL_ESTIMATORS",
    "PerTokenPolicyLoss",
    "PolicyLossConfig",
    "agg_loss",
    "entropy_from_logits",
    "kl_penalty",
    "masked_mean",
    "policy_loss",
    "policy_loss_per_token",
]

AggMode = Literal[
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]
AGG_MODES = get_args(AggMode)
KL_ESTIMATORS = ("k1", "abs", "k2", "k3")
_KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
# what kl_penalty takes: an estimator or alias, optionally with "+" (built from the two above)
KLKind = Literal[tuple(f"{k}{st}" for st in ("", "+") for k in (*KL_ESTIMATORS, *_KL_ALIASES))]
RatioLevel = Literal["token", "turn"]


def _check_shapes(reference_name: str, reference: Tensor, **others: Tensor | None) -> None:
    """Raise ``ValueError`` unless every tensor in ``others`` has ``reference``'s shape."""
    for name, tensor in others.items():
        if tensor is not None and tensor.shape != reference.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but {reference_name} has shape "
                f"{tuple(reference.shape)}; pass per-token tensors of the same (B, L) shape."
            )


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    r"""Mean of ``values`` over the positions where ``mask`` is 1.

    .. math:: \text{out} = \frac{\sum v \cdot m}{\max(\sum m, 1)}

    Args:
        values: any shape.
        mask: 0/1 (float or bool), same shape as ``values``.
        dim: reduce over this dimension only; ``None`` reduces over all elements.

    Returns:
        A scalar (``dim=None``) or ``values`` reduced over ``dim``. Where the mask is all 0 the
        result is 0 (not NaN), and so is its gradient.
    """
    _check_shapes("values", values, mask=mask)
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def agg_loss(
    values: Tensor,
    mask: Tensor,
    mode: str = "token-mean",
    *,
    num_tokens: float | None = None,
    loss_scale_factor: float | None = None,
) -> Tensor:
    r"""Reduce a per-token loss matrix to a scalar, as verl's ``agg_loss``.

    With :math:`v` the values and :math:`m` the mask, :math:`S_i = \sum_t v_{i,t} m_{i,t}`,
    :math:`n_i = \sum_t m_{i,t}` and :math:`\mathcal{I} = \{i : n_i > 0\}` (non-empty rows):

    * ``"token-mean"``: :math:`\sum_i S_i / N`, with :math:`N` = ``num_tokens`` if given, else
      :math:`\sum_i n_i`. Under data parallelism pass the *global* token count of the step as
      ``num_tokens`` (and sum, not average, the gradients across ranks) so that every token
      weighs the same whatever rank it landed on; verl's ``batch_num_tokens * dp_size`` does
      the same with averaged gradients.
    * ``"seq-mean-token-sum"``: :math:`\sum_i S_i / |\mathcal{I}|`.
    * ``"seq-mean-token-mean"``: :math:`\frac{1}{|\mathcal{I}|}\sum_{i\in\mathcal{I}}
      S_i / (n_i + 10^{-8})`.
    * ``"seq-mean-token-sum-norm"`` (Dr.GRPO): :math:`\sum_i S_i / F`, with :math:`F` =
      ``loss_scale_factor`` if given, else ``L`` (``mask.shape[-1]``), a constant.

    Args:
        values: ``(B, L)`` per-token losses.
        mask: ``(B, L)`` 0/1 loss mask (float or bool).
        mode: one of :data:`AGG_MODES`.
        num_tokens: ``"token-mean"`` only; the positive token count to divide by.
        loss_scale_factor: ``"seq-mean-token-sum-norm"`` only; the positive constant divisor.

    Returns:
        A scalar tensor. An all-zero mask (or all-empty rows) gives 0 with a zero gradient,
        never NaN.

    Raises:
        ValueError: on a shape mismatch, an unknown ``mode``, a non-positive ``num_tokens`` or
            ``loss_scale_factor``, or either one passed with a mode that does not use it.
    """
    _check_shapes("values", values, mask=mask)
    if mode not in AGG_MODES:
        raise ValueError(f"mode={mode!r} is not a loss aggregation mode; use one of {AGG_MODES}.")
    if num_tokens is not None and (mode != "token-mean" or num_tokens <= 0):
        raise ValueError(
            f"num_tokens={num_tokens!r} with mode={mode!r}: num_tokens must be a positive token "
            "count and only applies to mode='token-mean'; leave it None otherwise."
        )
    if loss_scale_factor is not None and (mode != AGG_MODES[3] or loss_scale_factor <= 0):
        raise ValueError(
            f"loss_scale_factor={loss_scale_factor!r} with mode={mode!r}: it must be positive and "
            f"only applies to mode='{AGG_MODES[3]}'; leave it None otherwise."
        )
    mask = mask.to(values.dtype)
    if mode == "token-mean":
        if num_tokens is None:
            return masked_mean(values, mask)
        return (values * mask).sum() / num_tokens
    if mode == "seq-mean-token-sum-norm":
        return (values * mask).sum() / (loss_scale_factor or mask.shape[-1])
    seq_sums = (values * mask).sum(-1)
    seq_counts = mask.sum(-1)
    if mode == "seq-mean-token-mean":
        seq_sums = seq_sums / (seq_counts + 1e-8)
    return masked_mean(seq_sums, seq_counts > 0)


@dataclass(frozen=True)
class PolicyLossConfig:
    """Settings of the clipped policy-gradient loss.

    The defaults are verl's actor defaults (``clip_ratio_low = clip_ratio_high = 0.2``,
    ``clip_ratio_c = 3.0``, ``loss_agg_mode = "token-mean"``). DAPO's clip-higher uses
    ``clip_low=0.2, clip_high=0.28``. A2TGPO's script uses ``ratio_level="turn"`` with
    ``clip_low=3e-3, clip_high=4e-3`` (turn ratios are geometric means, so they stay close to 1)
    and a per-token ``clip_scale``.
    """

    clip_low: float = 0.2
    """Lower clip range: the ratio is clipped from below at ``1 - clip_low`` (times ``clip_scale``)."""
    clip_high: float = 0.2
    """Upper clip range: the ratio is clipped from above at ``1 + clip_high`` (times ``clip_scale``)."""
    dual_clip_c: float | None = 3.0
    """Dual-clip bound for negative advantages (loss capped at ``-A * c``); must be > 1; None disables.
    Token level only."""
    agg_mode: AggMode = "token-mean"
    """How per-token losses become a scalar (verl's loss_agg_mode; :func:`ray_credit.losses.agg_loss`)."""
    ratio_level: RatioLevel = "token"
    """``"token"``: per-token ratios (PPO/GRPO). ``"turn"``: one geometric-mean ratio per turn (A2TGPO)."""
    log_ratio_clamp: float = 20.0
    """Token level: the log-ratio is clamped to ``[-log_ratio_clamp, log_ratio_clamp]`` before exp."""
    turn_log_ratio_max: float = 10.0
    """Turn level: the log-ratio is clamped from above at this value before exp."""
    loss_scale_factor: float | None = None
    """``"seq-mean-token-sum-norm"`` only: constant divisor; None uses the response length L."""

    def __post_init__(self) -> None:
        check_fields(self)  # types first: the checks below compare numbers
        if not 0.0 <= self.clip_low <= 1.0:
            raise ValueError(f"clip_low={self.clip_low} must lie in [0, 1], e.g. 0.2.")
        if not 0.0 <= self.clip_high < math.inf:
            raise ValueError(
                f"clip_high={self.clip_high} must be finite and >= 0, e.g. 0.2 or 0.28 (DAPO)."
            )
        if self.dual_clip_c is not None and not 1.0 < self.dual_clip_c < math.inf:
            raise ValueError(
                f"dual_clip_c={self.dual_clip_c} must be > 1 (verl uses 3.0); set None to disable."
            )
        if not (0 < self.log_ratio_clamp < math.inf and 0 < self.turn_log_ratio_max < math.inf):
            raise ValueError(
                "log_ratio_clamp and turn_log_ratio_max must be finite and > 0 (defaults 20 "
                f"and 10), got {self.log_ratio_clamp} and {self.turn_log_ratio_max}."
            )
        if self.loss_scale_factor is not None and (
            not 0 < self.loss_scale_factor < math.inf or self.agg_mode != "seq-mean-token-sum-norm"
        ):
            raise ValueError(
                f"loss_scale_factor={self.loss_scale_factor} must be > 0 and needs "
                "agg_mode='seq-mean-token-sum-norm'; leave it None otherwise."
            )


class PerTokenPolicyLoss(NamedTuple):
    """Output of :func:`policy_loss_per_token`; every field is ``(B, L)``."""

    loss: Tensor
    """Per-token loss (not masked: multiply by the mask or use :func:`agg_loss`)."""
    ratio: Tensor
    """Importance ratio used per token (the turn's ratio at turn level)."""
    clipped: Tensor
    """Bool: the clipped term won, ``L2 > L1``."""
    dual_clipped: Tensor
    """Bool: ``A < 0`` and the loss was capped at ``-A * dual_clip_c`` (always False at turn level)."""


def _turn_mean_log_ratio(log_ratio: Tensor, mask: Tensor, token_turn: Tensor) -> Tensor:
    """Per-token masked mean of ``log_ratio`` over the token's turn; 0 where ``token_turn < 0``."""
    if token_turn.dtype.is_floating_point or token_turn.dtype == torch.bool:
        raise ValueError(f"token_turn must be an integer tensor, got {token_turn.dtype}.")
    in_turn = token_turn >= 0
    if bool(((token_turn < -1) | (~in_turn & mask)).any()):
        raise ValueError(
            "token_turn must be >= -1 and give a turn id (>= 0) to every token where mask is 1; "
            "use -1 only for prompt, tool or padding positions."
        )
    num_turns = int(token_turn.max().clamp(min=0)) + 1
    rows = torch.arange(token_turn.shape[0], device=token_turn.device).unsqueeze(-1)
    segment = torch.where(in_turn, rows * num_turns + token_turn, 0).flatten()
    weight = mask.to(log_ratio.dtype).flatten()
    size = token_turn.shape[0] * num_turns
    sums = log_ratio.new_zeros(size).index_add_(0, segment, log_ratio.flatten() * weight)
    counts = log_ratio.new_zeros(size).index_add_(0, segment, weight)
    turn_mean = (sums / counts.clamp(min=1))[segment].view_as(log_ratio)
    return torch.where(in_turn, turn_mean, 0.0)


def policy_loss_per_token(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: PolicyLossConfig = PolicyLossConfig(),
    *,
    token_turn: Tensor | None = None,
    clip_scale: Tensor | None = None,
) -> PerTokenPolicyLoss:
    r"""Per-token clipped surrogate loss, at token level (PPO/GRPO) or turn level (A2TGPO).

    **Ratio.** Token level (verl ``compute_policy_loss_vanilla``):
    :math:`r_t = \exp(\text{clamp}(\log\pi_t - \log\pi^{old}_t, \pm\,\text{log\_ratio\_clamp}))`.
    Turn level (A2TGPO ``compute_policy_loss_gspo_turn``, GSPO applied per turn): with
    :math:`\bar\delta_k` the mean of :math:`\log\pi_t - \log\pi^{old}_t` over the mask-1 tokens
    of turn :math:`k`,
    :math:`r_t = \exp(\min(\log\pi_t - \text{sg}(\log\pi_t) + \text{sg}(\bar\delta_k),
    \text{turn\_log\_ratio\_max}))`. Its *value* is the turn's geometric-mean ratio
    :math:`\exp(\bar\delta_k)`; its *gradient* is :math:`r_t \nabla\log\pi_t` (stop-gradient
    trick, ``sg`` = ``detach``), so each token keeps its own score-function gradient.

    **Loss.** With clip bounds :math:`l_t = 1 - \epsilon_{low} s_t` and
    :math:`h_t = 1 + \epsilon_{high} s_t` (:math:`s_t` = ``clip_scale``, 1 if None; A2TGPO's
    adaptive clip :math:`\max(\min(r, h), l)`):

    .. math::
        L_1 = -A r, \quad L_2 = -A \max(\min(r, h), l), \quad L = \max(L_1, L_2)

    and, at token level with ``dual_clip_c`` = :math:`c`, :math:`L = \min(L, -A c)` where
    :math:`A < 0`. A2TGPO's turn-level loss has no dual clip, so ``dual_clip_c`` is ignored there.

    **Turns.** ``token_turn[i, t]`` is the turn index of token ``t`` within row ``i`` (ids are
    per row: turn 0 of row 0 and turn 0 of row 1 are different turns), or -1 for prompt/tool/
    padding positions. Tokens with id >= 0 and mask 0 receive their turn's ratio but do not count
    in its mean. This departs from the A2TGPO copy, which re-detects turns as runs of equal
    advantage and so merges adjacent turns whose advantages happen to be equal.

    Args:
        logprobs: ``(B, L)`` log-probs of the sampled tokens under the current policy.
        old_logprobs: ``(B, L)`` log-probs under the behaviour (rollout) policy.
        advantages: ``(B, L)`` per-token advantages.
        mask: ``(B, L)`` 0/1 loss mask.
        config: loss settings (:class:`PolicyLossConfig`; defaults are verl's).
        token_turn: ``(B, L)`` integer turn ids; required iff ``config.ratio_level == "turn"``.
        clip_scale: optional ``(B, L)`` positive per-token multiplier of the clip ranges.

    Returns:
        :class:`PerTokenPolicyLoss` of ``(B, L)`` tensors: loss, ratio, clipped, dual_clipped.

    Raises:
        ValueError: on shape mismatch, a missing/unexpected/invalid ``token_turn``.
    """
    _check_shapes(
        "logprobs", logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask,
        token_turn=token_turn, clip_scale=clip_scale,
    )  # fmt: skip
    turn_level = config.ratio_level == "turn"
    if turn_level != (token_turn is not None):
        given = "None" if token_turn is None else "a tensor"
        raise ValueError(
            f"token_turn is {given} but config.ratio_level={config.ratio_level!r}: pass token_turn "
            "exactly when ratio_level='turn' (set ratio_level='turn' or drop token_turn)."
        )
    log_ratio = logprobs - old_logprobs
    if turn_level:
        turn_mean = _turn_mean_log_ratio(log_ratio.detach(), mask.bool(), token_turn)
        log_ratio = logprobs - logprobs.detach() + turn_mean
        ratio = torch.exp(log_ratio.clamp(max=config.turn_log_ratio_max))
    else:
        ratio = torch.exp(log_ratio.clamp(-config.log_ratio_clamp, config.log_ratio_clamp))
    scale = 1.0 if clip_scale is None else clip_scale
    # max(min(r, h), l), the A2TGPO order; l <= 1 <= h whenever clip_scale >= 0.
    clipped_ratio = ratio.clamp(max=1.0 + config.clip_high * scale).clamp(
        min=1.0 - config.clip_low * scale
    )
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * clipped_ratio
    loss = torch.maximum(unclipped_loss, clipped_loss)
    clipped = clipped_loss > unclipped_loss
    dual_clipped = torch.zeros_like(clipped)
    if config.dual_clip_c is not None and not turn_level:
        cap = -advantages * config.dual_clip_c
        dual_clipped = (advantages < 0) & (loss > cap)
        loss = torch.where(dual_clipped, cap, loss)
    return PerTokenPolicyLoss(loss, ratio, clipped, dual_clipped)


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: PolicyLossConfig = PolicyLossConfig(),
    *,
    token_turn: Tensor | None = None,
    clip_scale: Tensor | None = None,
    num_tokens: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""Clipped policy-gradient loss aggregated to a scalar, with diagnostics.

    Computes :func:`policy_loss_per_token` (see it for the equations, the turn-level ratio and
    ``clip_scale``), then :func:`agg_loss` with ``config.agg_mode`` and
    ``config.loss_scale_factor``. ``num_tokens`` is forwarded to :func:`agg_loss` (``"token-mean"``
    only: the global token count under data parallelism).

    Args:
        logprobs: ``(B, L)``, as in :func:`policy_loss_per_token`.
        old_logprobs: ``(B, L)``, as in :func:`policy_loss_per_token`.
        advantages: ``(B, L)``, as in :func:`policy_loss_per_token`.
        mask: ``(B, L)``, as in :func:`policy_loss_per_token`.
        config: loss settings (:class:`PolicyLossConfig`; defaults are verl's).
        token_turn: ``(B, L)`` integer turn ids (-1 outside turns); turn level only.
        clip_scale: optional ``(B, L)`` per-token clip-range multiplier (A2TGPO adaptive clip).
        num_tokens: optional positive token count for ``"token-mean"``.

    Returns:
        ``(loss, metrics)``: a scalar loss, and detached scalar metrics, each a mean over the
        mask-1 tokens of this call (0 when the mask is empty):

        * ``clipfrac``: fraction where the clipped term won (``L2 > L1``);
        * ``clipfrac_lower``: fraction where the dual clip capped the loss (0 at turn level);
        * ``approx_kl``: mean of :math:`\log\pi^{old} - \log\pi`, the log-ratio clamped
        to ``±log_ratio_clamp`` (verl's ``ppo_kl``);
        * ``ratio_mean``, ``ratio_max``: of the ratio actually used (turn ratio at turn level).
    """
    per_token = policy_loss_per_token(
        logprobs, old_logprobs, advantages, mask, config,
        token_turn=token_turn, clip_scale=clip_scale,
    )  # fmt: skip
    loss = agg_loss(
        per_token.loss, mask, config.agg_mode,
        num_tokens=num_tokens, loss_scale_factor=config.loss_scale_factor,
    )  # fmt: skip
    with torch.no_grad():
        log_ratio = (logprobs - old_logprobs).clamp(-config.log_ratio_clamp, config.log_ratio_clamp)
        ratio = per_token.ratio.detach()
        metrics = {
            "clipfrac": masked_mean(per_token.clipped.to(ratio.dtype), mask),
            "clipfrac_lower": masked_mean(per_token.dual_clipped.to(ratio.dtype), mask),
            "approx_kl": masked_mean(-log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
            # Ratios are positive, so zeroing masked tokens leaves the max intact (0 if empty).
            "ratio_max": (ratio * mask.to(ratio.dtype)).amax() if ratio.numel() else ratio.sum(),
        }
    return loss, metrics


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k3") -> Tensor:
    r"""Per-token KL estimate between the policy and a reference, as verl's ``kl_penalty``.

    With :math:`\delta = \log\pi - \log\pi_{ref}`:

    * ``"k1"`` (alias ``"kl"``): :math:`\delta`;
    * ``"abs"``: :math:`|\delta|`;
    * ``"k2"`` (alias ``"mse"``): :math:`\tfrac12\delta^2`;
    * ``"k3"`` (alias ``"low_var_kl"``): with :math:`\kappa = \text{clamp}(-\delta, -20, 20)`,
      :math:`\text{clamp}(e^{\kappa} - \kappa - 1, -10, 10)` (Schulman's low-variance, non-negative
      estimator; the clamps keep it finite).

    A trailing ``"+"`` (e.g. ``"k3+"``) is a straight-through variant: the forward value is the
    named estimator's, the gradient is k2's (:math:`\delta\nabla\log\pi`, unbiased for the KL
    gradient): ``k2 + sg(est - k2)``.

    Args:
        logprobs: ``(B, L)`` log-probs under the policy.
        ref_logprobs: ``(B, L)`` log-probs under the reference policy.
        kind: an estimator name, alias, or either followed by ``"+"``.

    Returns:
        ``(B, L)`` per-token estimates (aggregate with :func:`agg_loss`).

    Raises:
        ValueError: on a shape mismatch or an unknown ``kind``.
    """
    _check_shapes("logprobs", logprobs, ref_logprobs=ref_logprobs)
    straight_through = kind.endswith("+")
    base = _KL_ALIASES.get(kind.removesuffix("+"), kind.removesuffix("+"))
    if base not in KL_ESTIMATORS:
        valid = KL_ESTIMATORS + tuple(_KL_ALIASES)
        raise ValueError(
            f"kind={kind!r} is not a KL estimator; use one of {valid}, optionally with a "
            "trailing '+' for the straight-through k2 gradient (e.g. 'k3+')."
        )
    delta = logprobs - ref_logprobs
    k2 = 0.5 * delta.square()
    if base == "k1":
        estimate = delta
    elif base == "abs":
        estimate = delta.abs()
    elif base == "k2":
        estimate = k2
    else:
        kappa = (-delta).clamp(-20.0, 20.0)
        estimate = (torch.exp(kappa) - kappa - 1.0).clamp(-10.0, 10.0)
    if straight_through:
        return k2 + (estimate - k2).detach()
    return estimate


def entropy_from_logits(logits: Tensor) -> Tensor:
    r"""Entropy of the categorical distribution given by ``logits`` over the last dimension.

    .. math:: H = \operatorname{logsumexp}(z) - \sum_v \operatorname{softmax}(z)_v z_v

    computed on :math:`z` = ``logits`` minus their (detached) row max, which leaves :math:`H` and
    its gradient unchanged but keeps both terms small, so very large logits neither overflow nor
    lose precision to cancellation.

    Args:
        logits: ``(B, L, V)`` (or any ``(..., V)``) finite logits.

    Returns:
        ``(B, L)`` (``logits.shape[:-1]``) entropies in nats, in ``[0, log V]``.
    """
    shifted = logits - logits.amax(dim=-1, keepdim=True).detach()
    probs = torch.softmax(shifted, dim=-1)
    return torch.logsumexp(shifted, dim=-1) - (probs * shifted).sum(dim=-1)
