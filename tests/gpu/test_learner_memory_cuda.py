"""The learner's memory settings on CUDA (skipped without a GPU): a LoRA update under bf16
autocast publishes peft's own merge of its adapters, and gradient checkpointing gives the
gradient of the plain pass."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from tests.unit.test_learner import GradRecorder, batch  # noqa: F401 (fixture)

pytestmark = pytest.mark.gpu


def test_lora_under_bf16_autocast_publishes_the_merged_adapters(batch):  # noqa: F811
    import torch

    from ray_credit.actors.learner import Learner, LearnerConfig
    from ray_credit.actors.lora import LoraConfig
    from ray_credit.models import load_model

    config = LearnerConfig(lr=1e-2, lora=LoraConfig(rank=4, alpha=8.0), autocast="bfloat16")
    learner = Learner(load_model("tiny-random", device="cuda"), config, device="cuda")
    learner.train(batch)
    published = learner.get_weights()
    merged = copy.deepcopy(learner.model).merge_and_unload().state_dict()
    for name, value in merged.items():
        torch.testing.assert_close(published[name].cuda(), value, rtol=0, atol=1e-6)


def test_gradient_checkpointing_on_cuda_gives_the_same_gradient(batch):  # noqa: F811
    import torch

    from ray_credit.actors.learner import LearnerConfig
    from ray_credit.models import load_model

    torch.backends.cuda.matmul.allow_tf32 = False
    config = LearnerConfig(lr=1e-3, share_prefix=False, shuffle=False)
    plain = GradRecorder(load_model("tiny-random", device="cuda"), config, device="cuda")
    saving = GradRecorder(
        load_model("tiny-random", device="cuda"),
        replace(config, gradient_checkpointing=True),
        device="cuda",
    )
    plain.train(batch)
    saving.train(batch)
    for name, grad in plain.grads.items():
        torch.testing.assert_close(saving.grads[name], grad, rtol=1e-4, atol=1e-6)
