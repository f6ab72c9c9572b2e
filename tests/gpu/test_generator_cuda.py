"""The transformers backend on CUDA: rollouts whose behavior logprobs match a teacher-forced
pass on the same device, and the info-gain scorer on the same device as on the CPU."""

import numpy as np
import pytest

from ray_credit.testing import max_logprob_gap
from tests.unit.test_generator import QUESTIONS, WordRetriever

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny_cuda():
    import torch

    from ray_credit.models import load_model

    torch.backends.cuda.matmul.allow_tf32 = False  # exact float32, as on the CPU
    return load_model("tiny-random", device="cuda")


def test_cuda_rollout_logprobs_match_teacher_forcing(tiny_cuda):

    from ray_credit.actors.generator import Generator, GeneratorConfig

    model, _ = tiny_cuda
    assert next(model.parameters()).device.type == "cuda"
    config = GeneratorConfig(group_size=4, max_turns=2, max_new_tokens=12, seed=3, max_batch_size=3)
    batch = Generator(tiny_cuda, WordRetriever(), config).generate(QUESTIONS)
    assert len(batch) == 8 and batch.metrics["gen/generated_tokens"] > 0
    worst = max_logprob_gap(model, batch)
    print(f"\nCUDA: max |behavior - teacher-forced logprob| = {worst:.2e}")
    assert worst < 1e-3


def test_cuda_scorer_matches_cpu(tiny_cuda):
    from ray_credit.actors.generator import Generator, GeneratorConfig
    from ray_credit.actors.scorer import InfoGainScorer
    from ray_credit.models import load_model

    config = GeneratorConfig(group_size=2, max_turns=2, max_new_tokens=10, seed=5)
    batch = Generator(tiny_cuda, WordRetriever(), config).generate(QUESTIONS)
    on_cuda = InfoGainScorer(tiny_cuda).score(batch).turn_view("turn_info_gain")
    on_cpu = InfoGainScorer(load_model("tiny-random")).score(batch).turn_view("turn_info_gain")
    assert (on_cuda[1] == on_cpu[1]).all()
    np.testing.assert_allclose(on_cuda[0][on_cuda[1]], on_cpu[0][on_cpu[1]], atol=1e-4)
