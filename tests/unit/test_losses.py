"""Unit tests for ray_credit.losses (hand-computed vectors)."""

from __future__ import annotations

import math

import pytest
import torch

from ray_credit.losses import (
    AGG_MODES,
    KL_ESTIMATORS,
    PolicyLossConfig,
    agg_loss,
    entropy_from_logits,
    kl_penalty,
    masked_mean,
    policy_loss,
    policy_loss_per_token,
)

ATOL = 1e-5


def close(actual: torch.Tensor | float, expected, atol: float = ATOL) -> None:
    actual = torch.as_tensor(actual, dtype=torch.float64)
    expected = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


def logs(ratios: list[list[float]]) -> torch.Tensor:
    return torch.tensor(ratios, dtype=torch.float64).log()


# ----------------------------------------------------------------------------- agg_loss

AGG_VALUES = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
AGG_MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 2.5),
        ("seq-mean-token-sum", 5.0),
        ("seq-mean-token-mean", 3.0),
        ("seq-mean-token-sum-norm", 2.5),
    ],
)
def test_agg_loss_vectors(mode: str, expected: float) -> None:
    close(agg_loss(AGG_VALUES, AGG_MASK, mode), expected)
    close(agg_loss(AGG_VALUES, AGG_MASK.bool(), mode), expected)


def test_agg_loss_ignores_empty_rows_in_seq_modes() -> None:
    values = torch.cat([AGG_VALUES, torch.full((1, 4), 7.0)])
    mask = torch.cat([AGG_MASK, torch.zeros(1, 4)])
    close(agg_loss(values, mask, "seq-mean-token-sum"), 5.0)
    close(agg_loss(values, mask, "seq-mean-token-mean"), 3.0)


def test_agg_loss_num_tokens_and_scale_factor_overrides() -> None:
    close(agg_loss(AGG_VALUES, AGG_MASK, num_tokens=20), 0.5)
    close(agg_loss(AGG_VALUES, AGG_MASK, "seq-mean-token-sum-norm", loss_scale_factor=5.0), 2.0)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_empty_mask_is_zero_with_finite_grad(mode: str) -> None:
    values = torch.randn(2, 3, requires_grad=True)
    loss = agg_loss(values, torch.zeros(2, 3), mode)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.isfinite(values.grad).all()


def test_agg_loss_bad_input() -> None:
    with pytest.raises(ValueError, match="mode="):
        agg_loss(AGG_VALUES, AGG_MASK, "mean")
    with pytest.raises(ValueError, match="mask has shape"):
        agg_loss(AGG_VALUES, AGG_MASK[:, :3])
    with pytest.raises(ValueError, match="num_tokens"):
        agg_loss(AGG_VALUES, AGG_MASK, "seq-mean-token-sum", num_tokens=4)
    with pytest.raises(ValueError, match="num_tokens"):
        agg_loss(AGG_VALUES, AGG_MASK, num_tokens=0)
    with pytest.raises(ValueError, match="loss_scale_factor"):
        agg_loss(AGG_VALUES, AGG_MASK, "token-mean", loss_scale_factor=4.0)


def test_masked_mean_dim() -> None:
    close(masked_mean(AGG_VALUES, AGG_MASK, dim=-1), [2.0, 4.0])
    close(masked_mean(AGG_VALUES, torch.zeros(2, 4)), 0.0)


# ----------------------------------------------------------------------- token-level loss

DAPO = PolicyLossConfig(clip_low=0.2, clip_high=0.28, dual_clip_c=3.0)


def token_vector_inputs() -> tuple[torch.Tensor, ...]:
    logprobs = logs([[1.5, 0.5, 1.1, 5.0]])
    return logprobs, torch.zeros_like(logprobs), torch.tensor([[1.0, 1.0, -1.0, -1.0]])


def test_token_level_vector() -> None:
    logprobs, old, adv = token_vector_inputs()
    mask = torch.ones_like(logprobs)
    per_token = policy_loss_per_token(logprobs, old, adv, mask, DAPO)
    close(per_token.loss, [[-1.28, -0.5, 1.1, 3.0]])
    assert per_token.clipped.tolist() == [[True, False, False, False]]
    assert per_token.dual_clipped.tolist() == [[False, False, False, True]]
    loss, metrics = policy_loss(logprobs, old, adv, mask, DAPO)
    close(loss, 0.58)
    close(metrics["clipfrac"], 0.25)
    close(metrics["clipfrac_lower"], 0.25)
    close(metrics["approx_kl"], -0.354267)
    close(metrics["ratio_mean"], (1.5 + 0.5 + 1.1 + 5.0) / 4)
    close(metrics["ratio_max"], 5.0)
    assert all(not value.requires_grad and value.dim() == 0 for value in metrics.values())


def test_dual_clip_disabled_keeps_unbounded_negative_advantage_loss() -> None:
    logprobs, old, adv = token_vector_inputs()
    config = PolicyLossConfig(clip_low=0.2, clip_high=0.28, dual_clip_c=None)
    per_token = policy_loss_per_token(logprobs, old, adv, torch.ones_like(adv), config)
    close(per_token.loss, [[-1.28, -0.5, 1.1, 5.0]])
    assert not per_token.dual_clipped.any()


def test_clip_higher_is_asymmetric() -> None:
    ratios = [[1.25, 1.25, 0.75]]
    logprobs, adv = logs(ratios), torch.tensor([[1.0, -1.0, -1.0]])
    args = (logprobs, torch.zeros_like(logprobs), adv, torch.ones_like(adv))
    symmetric = policy_loss_per_token(*args, PolicyLossConfig(clip_low=0.2, clip_high=0.2))
    higher = policy_loss_per_token(*args, PolicyLossConfig(clip_low=0.2, clip_high=0.28))
    # A > 0, r = 1.25: clipped to 1.2 symmetrically, not clipped under clip-higher (1.28).
    close(symmetric.loss, [[-1.2, 1.25, 0.8]])
    close(higher.loss, [[-1.25, 1.25, 0.8]])
    assert symmetric.clipped.tolist() == [[True, False, True]]
    assert higher.clipped.tolist() == [[False, False, True]]


def test_clip_scale_at_token_level() -> None:
    logprobs = logs([[1.25, 1.25, 0.85, 0.85]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    scale = torch.tensor([[0.5, 2.0, 0.5, 2.0]])
    args = (logprobs, torch.zeros_like(logprobs), adv, torch.ones_like(adv))
    per_token = policy_loss_per_token(*args, PolicyLossConfig(), clip_scale=scale)
    # Bounds: [0.9, 1.1], [0.6, 1.4], [0.9, 1.1], [0.6, 1.4].
    close(per_token.loss, [[-1.1, -1.25, 0.9, 0.85]])
    assert per_token.clipped.tolist() == [[True, False, True, False]]
    ones = policy_loss_per_token(*args, PolicyLossConfig(), clip_scale=torch.ones_like(adv))
    close(ones.loss, policy_loss_per_token(*args, PolicyLossConfig()).loss)


def test_token_level_log_ratio_is_clamped() -> None:
    logprobs = torch.tensor([[0.0, 0.0]])
    old = torch.tensor([[-50.0, 50.0]])
    ratio = policy_loss_per_token(logprobs, old, torch.ones(1, 2), torch.ones(1, 2)).ratio
    close(ratio.log(), [[20.0, -20.0]], atol=1e-4)


def test_num_tokens_override_in_policy_loss() -> None:
    logprobs, old, adv = token_vector_inputs()
    loss, _ = policy_loss(logprobs, old, adv, torch.ones_like(adv), DAPO, num_tokens=8)
    close(loss, 0.58 * 4 / 8)


def test_empty_mask_gives_zero_loss_and_metrics() -> None:
    logprobs = torch.randn(2, 3, requires_grad=True)
    zeros = torch.zeros(2, 3)
    loss, metrics = policy_loss(logprobs, torch.randn(2, 3), torch.randn(2, 3), zeros)
    loss.backward()
    assert loss.item() == 0.0
    assert all(value.item() == 0.0 for value in metrics.values())
    assert torch.isfinite(logprobs.grad).all()
    turn_config = PolicyLossConfig(ratio_level="turn")
    turn_ids = torch.full((2, 3), -1)
    loss, _ = policy_loss(logprobs, zeros, zeros, zeros, turn_config, token_turn=turn_ids)
    assert loss.item() == 0.0


def test_token_level_gradient_matches_unclipped_score_function() -> None:
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = logprobs.detach() - 0.05
    adv = torch.tensor([[1.0, -2.0, 0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, _ = policy_loss(logprobs, old, adv, mask)
    loss.backward()
    close(logprobs.grad, -adv * math.exp(0.05) * mask / 2)


# ------------------------------------------------------------------------ turn-level loss

TURN = PolicyLossConfig(clip_low=0.2, clip_high=0.2, ratio_level="turn")


def turn_vector_inputs() -> tuple[torch.Tensor, ...]:
    logprobs = logs([[1.3, 1.1, 0.9, 0.8]])
    adv = torch.tensor([[1.0, 1.0, -0.5, -0.5]], dtype=torch.float64)
    return logprobs, torch.zeros_like(logprobs), adv, torch.tensor([[0, 0, 1, 1]])


def test_turn_level_vector_fixed_clip() -> None:
    logprobs, old, adv, turns = turn_vector_inputs()
    mask = torch.ones_like(adv)
    per_token = policy_loss_per_token(logprobs, old, adv, mask, TURN, token_turn=turns)
    close(per_token.ratio, [[1.195826, 1.195826, 0.848528, 0.848528]])
    assert not per_token.dual_clipped.any()
    loss, metrics = policy_loss(logprobs, old, adv, mask, TURN, token_turn=turns)
    close(loss, -0.385781)
    close(metrics["clipfrac"], 0.0)
    close(metrics["clipfrac_lower"], 0.0)
    close(metrics["ratio_max"], 1.195826)


def test_turn_level_vector_dynamic_clip() -> None:
    logprobs, old, adv, turns = turn_vector_inputs()
    scale = torch.tensor([[1.3, 1.3, 0.7, 0.7]], dtype=torch.float64)
    loss, metrics = policy_loss(
        logprobs, old, adv, torch.ones_like(adv), TURN, token_turn=turns, clip_scale=scale
    )
    close(loss, -0.382913)
    close(metrics["clipfrac"], 0.5)


def test_turn_level_has_no_dual_clip() -> None:
    logprobs = logs([[5.0, 5.0]])
    adv = -torch.ones_like(logprobs)
    config = PolicyLossConfig(ratio_level="turn", dual_clip_c=3.0)
    turns = torch.tensor([[0, 0]])
    per_token = policy_loss_per_token(
        logprobs, torch.zeros_like(logprobs), adv, torch.ones_like(adv), config, token_turn=turns
    )
    close(per_token.loss, [[5.0, 5.0]])
    assert not per_token.dual_clipped.any()


def test_turn_level_gradient_flows_to_logprobs() -> None:
    logprobs_data, old, adv, turns = turn_vector_inputs()
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    turns = torch.tensor([[0, 0, 1, 1]])
    logprobs = logprobs_data.clone().requires_grad_(True)
    loss, _ = policy_loss(logprobs, old, adv, mask, TURN, token_turn=turns)
    loss.backward()
    grad = logprobs.grad
    assert torch.isfinite(grad).all()
    assert grad[0, 3].item() == 0.0
    # Unclipped tokens: d/dlogp_t of -A r_turn is -A r_turn (stop-gradient trick); turn 1 has
    # only its first token in the mask, so its ratio is 0.9 (inside [0.8, 1.2]).
    turn_ratio = torch.tensor([[math.sqrt(1.43), math.sqrt(1.43), 0.9, 0.9]], dtype=torch.float64)
    close(grad, -adv * turn_ratio * mask / 3)


def test_turn_level_two_rows_with_padding_and_different_turn_counts() -> None:
    logprobs = logs([[1.2, 1.0, 0.5, 0.9, 1.1], [1.4, 1.4, 1.4, 0.6, 1.0]])
    turns = torch.tensor([[-1, 0, 0, 1, 2], [0, 0, 0, -1, -1]])
    # Row 0: position 2 is a tool token inside turn 0 (mask 0, excluded from the turn mean).
    mask = torch.tensor([[0, 1, 0, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.float64)
    adv = torch.ones_like(logprobs)
    config = PolicyLossConfig(clip_low=10.0 / 11.0, clip_high=10.0, ratio_level="turn")
    per_token = policy_loss_per_token(
        logprobs, torch.zeros_like(logprobs), adv, mask, config, token_turn=turns
    )
    # Turn ids are per row: row 1's turn 0 is not row 0's turn 0. Positions with id -1 get 1.
    close(per_token.ratio, [[1.0, 1.0, 1.0, 0.9, 1.1], [1.4, 1.4, 1.4, 1.0, 1.0]])


def slow_turn_ratios(
    logprobs: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, turns: torch.Tensor
) -> torch.Tensor:
    expected = torch.ones_like(logprobs)
    for row in range(logprobs.shape[0]):
        for turn in set(turns[row].tolist()) - {-1}:
            in_turn = turns[row] == turn
            counted = [
                (logprobs[row, t] - old[row, t]).item()
                for t in range(logprobs.shape[1])
                if in_turn[t] and mask[row, t] > 0
            ]
            mean = sum(counted) / len(counted) if counted else 0.0
            expected[row, in_turn] = math.exp(min(mean, 10.0))
    return expected


@pytest.mark.parametrize("seed", range(5))
def test_turn_ratio_matches_slow_reference(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    batch, length = 6, 24
    logprobs = -torch.rand(batch, length, generator=generator, dtype=torch.float64) * 3
    old = logprobs + 0.3 * torch.randn(batch, length, generator=generator, dtype=torch.float64)
    turns = torch.full((batch, length), -1)
    mask = torch.zeros(batch, length, dtype=torch.float64)
    for row in range(batch):
        start = int(torch.randint(0, 4, (1,), generator=generator))
        end = int(torch.randint(start + 1, length + 1, (1,), generator=generator))
        num_turns = int(torch.randint(1, 5, (1,), generator=generator))
        cuts = sorted(torch.randint(start, end, (num_turns - 1,), generator=generator).tolist())
        bounds = [start, *cuts, end]
        for turn, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            turns[row, lo:hi] = turn
        mask[row, start:end] = (torch.rand(end - start, generator=generator) < 0.8).double()
    advantages = torch.randn(batch, length, generator=generator, dtype=torch.float64)
    config = PolicyLossConfig(ratio_level="turn")
    per_token = policy_loss_per_token(logprobs, old, advantages, mask, config, token_turn=turns)
    close(per_token.ratio, slow_turn_ratios(logprobs, old, mask, turns), atol=1e-9)


def test_turn_level_bad_token_turn() -> None:
    logprobs, old, adv, turns = turn_vector_inputs()
    mask = torch.ones_like(adv)
    with pytest.raises(ValueError, match="token_turn"):
        policy_loss(logprobs, old, adv, mask, TURN)
    with pytest.raises(ValueError, match="token_turn"):
        policy_loss(logprobs, old, adv, mask, PolicyLossConfig(), token_turn=turns)
    with pytest.raises(ValueError, match="token_turn"):
        policy_loss(logprobs, old, adv, mask, TURN, token_turn=torch.tensor([[0, 0, -1, 1]]))
    with pytest.raises(ValueError, match="integer"):
        policy_loss(logprobs, old, adv, mask, TURN, token_turn=turns.double())
    with pytest.raises(ValueError, match="token_turn has shape"):
        policy_loss(logprobs, old, adv, mask, TURN, token_turn=turns[:, :3])


# ------------------------------------------------------------------------------ config


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"dual_clip_c": 1.0}, "dual_clip_c"),
        ({"dual_clip_c": 0.5}, "dual_clip_c"),
        ({"clip_low": -0.1}, "clip_low"),
        ({"clip_low": 1.5}, "clip_low"),
        ({"clip_high": -0.1}, "clip_high"),
        ({"agg_mode": "mean"}, "agg_mode"),
        ({"ratio_level": "sequence"}, "ratio_level"),
        ({"log_ratio_clamp": 0.0}, "log_ratio_clamp"),
        ({"turn_log_ratio_max": -1.0}, "turn_log_ratio_max"),
        ({"loss_scale_factor": 4.0}, "loss_scale_factor"),
        ({"loss_scale_factor": 0.0, "agg_mode": "seq-mean-token-sum-norm"}, "loss_scale_factor"),
    ],
)
def test_invalid_config(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        PolicyLossConfig(**kwargs)


def test_config_defaults_are_verl_actor_defaults() -> None:
    config = PolicyLossConfig()
    assert (config.clip_low, config.clip_high, config.dual_clip_c) == (0.2, 0.2, 3.0)
    assert (config.agg_mode, config.ratio_level) == ("token-mean", "token")
    dr_grpo = PolicyLossConfig(agg_mode="seq-mean-token-sum-norm", loss_scale_factor=4.0)
    assert dr_grpo.loss_scale_factor == 4.0


def test_policy_loss_shape_mismatch() -> None:
    logprobs, old, adv = token_vector_inputs()
    with pytest.raises(ValueError, match="advantages has shape"):
        policy_loss(logprobs, old, adv[:, :2], torch.ones_like(logprobs))


# ---------------------------------------------------------------------------------- KL

KL_LOGPROBS = torch.tensor([-1.0, -2.0], dtype=torch.float64)
KL_REF = torch.tensor([-1.5, -1.0], dtype=torch.float64)
KL_EXPECTED = {
    "k1": [0.5, -1.0],
    "abs": [0.5, 1.0],
    "k2": [0.125, 0.5],
    "k3": [0.106531, 0.718282],
}


@pytest.mark.parametrize("kind", KL_ESTIMATORS)
def test_kl_vectors(kind: str) -> None:
    close(kl_penalty(KL_LOGPROBS, KL_REF, kind), KL_EXPECTED[kind])


@pytest.mark.parametrize("alias, kind", [("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")])
def test_kl_aliases(alias: str, kind: str) -> None:
    close(kl_penalty(KL_LOGPROBS, KL_REF, alias), KL_EXPECTED[kind])


@pytest.mark.parametrize("kind", [*KL_ESTIMATORS, "low_var_kl", "kl"])
def test_kl_straight_through_value_of_base_gradient_of_k2(kind: str) -> None:
    logprobs = KL_LOGPROBS.clone().requires_grad_(True)
    value = kl_penalty(logprobs, KL_REF, kind + "+")
    close(value.detach(), kl_penalty(KL_LOGPROBS, KL_REF, kind))
    value.sum().backward()
    close(logprobs.grad, KL_LOGPROBS - KL_REF)


def test_kl_k3_is_clamped_and_default() -> None:
    logprobs = torch.tensor([[0.0, 0.0, 0.0]], requires_grad=True)
    value = kl_penalty(logprobs, torch.tensor([[1000.0, -1000.0, 2.0]]))
    close(value.detach(), [[10.0, 10.0, math.exp(2.0) - 3.0]])
    value.sum().backward()
    assert torch.isfinite(logprobs.grad).all()
    close(kl_penalty(KL_LOGPROBS, KL_REF), KL_EXPECTED["k3"])


def test_kl_bad_input() -> None:
    with pytest.raises(ValueError, match="kind='full'"):
        kl_penalty(KL_LOGPROBS, KL_REF, "full")
    with pytest.raises(ValueError, match="ref_logprobs has shape"):
        kl_penalty(KL_LOGPROBS, KL_REF[:1])


# ----------------------------------------------------------------------------- entropy


def test_entropy_matches_categorical() -> None:
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0)) * 4
    expected = torch.distributions.Categorical(logits=logits).entropy()
    assert entropy_from_logits(logits).shape == (3, 5)
    close(entropy_from_logits(logits), expected)


def test_entropy_large_logits_stable() -> None:
    generator = torch.Generator().manual_seed(1)
    noise = torch.randn(2, 4, 50, generator=generator, dtype=torch.float64)
    logits = (1e4 + noise).float().requires_grad_(True)
    entropy = entropy_from_logits(logits)
    entropy.sum().backward()
    assert torch.isfinite(entropy).all() and torch.isfinite(logits.grad).all()
    expected = torch.distributions.Categorical(logits=logits.detach().double()).entropy()
    close(entropy, expected, atol=1e-4)
    peaked = torch.tensor([[0.0, 1e6, -1e6]])
    close(entropy_from_logits(peaked), [0.0])
