"""The losses and the learner view on CUDA give the CPU numbers."""

import numpy as np
import pytest

from ray_credit.testing import random_batch

pytestmark = pytest.mark.gpu


def test_policy_loss_on_cuda_matches_cpu():
    import torch

    from ray_credit.losses import PolicyLossConfig, kl_penalty, policy_loss

    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 16, generator=gen)
    old = logp + 0.1 * torch.randn(4, 16, generator=gen)
    adv = torch.randn(4, 16, generator=gen)
    mask = (torch.rand(4, 16, generator=gen) > 0.2).float()
    turn = torch.arange(16).repeat(4, 1) // 4
    for config, kwargs in [
        (PolicyLossConfig(), {}),
        (PolicyLossConfig(ratio_level="turn", clip_low=3e-3, clip_high=4e-3), {"token_turn": turn}),
    ]:
        cpu, _ = policy_loss(logp, old, adv, mask, config, **kwargs)
        cuda_kwargs = {k: v.cuda() for k, v in kwargs.items()}
        gpu, _ = policy_loss(
            logp.cuda(), old.cuda(), adv.cuda(), mask.cuda(), config, **cuda_kwargs
        )
        assert gpu.item() == pytest.approx(cpu.item(), rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(
        kl_penalty(logp.cuda(), old.cuda()).cpu(), kl_penalty(logp, old), rtol=1e-5
    )


def test_to_torch_on_cuda():
    batch = random_batch(0, num_groups=2)
    rows = batch.to_records()
    for row in rows:
        n = len(row["turns"])
        row.update(
            input_ids=[1, 2] + [3] * n,
            loss_mask=[0, 0] + [1] * n,
            token_turn=[-1, -1] + list(range(n)),
            behavior_logprobs=[0.0, 0.0] + [-1.0] * n,
        )
    from ray_credit import TrajectoryBatch, get_estimator

    batch = get_estimator("grpo")(TrajectoryBatch.from_records(rows))
    tensors = batch.to_torch(device="cuda")
    assert all(t.is_cuda for t in tensors.values())
    assert tensors["advantages"].cpu().tolist() == batch.to_torch()["advantages"].tolist()
