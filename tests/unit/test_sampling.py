"""TransformersSampler: KV reuse across turns is exact and never outlives the weights;
the inverse-CDF draw samples the filtered distribution."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ray_credit.actors.sampling import SamplingParams, TransformersSampler, _pick  # noqa: E402
from ray_credit.models import load_model  # noqa: E402

PREAMBLE = list(range(100, 160))  # a shared few-shot preamble, 60 tokens
CONTEXTS = [PREAMBLE + [200 + q] * 3 for q in range(3) for _ in range(3)]  # 3 groups of G=3


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random")


def rollout(sampler, *, turns=3, temperature=0.0, max_new_tokens=10):
    """Three turns; each appends the sample and a 3-token 'observation' per row."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, stop=())
    contexts, out = [list(c) for c in CONTEXTS], []
    for turn in range(turns):
        samples = sampler.sample(contexts, params, seed=turn)
        out.append(samples)
        contexts = [
            c + s.token_ids + [300 + turn, 301, 302 + i]
            for i, (c, s) in enumerate(zip(contexts, samples, strict=True))
        ]
    return out


def assert_same(a, b, tol=1e-5):
    for turn_a, turn_b in zip(a, b, strict=True):
        for x, y in zip(turn_a, turn_b, strict=True):
            assert x.token_ids == y.token_ids
            assert x.hit_limit == y.hit_limit
            assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs, strict=True)) < tol


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("max_batch_size", [4, 64])
def test_reuse_equals_reencoding(tiny, temperature, max_batch_size):
    fresh = TransformersSampler(*tiny, kv_reuse_gb=0, max_batch_size=max_batch_size)
    reuse = TransformersSampler(*tiny, kv_reuse_gb=1.0, max_batch_size=max_batch_size)
    assert_same(rollout(fresh, temperature=temperature), rollout(reuse, temperature=temperature))
    stats, plain = reuse.stats(), fresh.stats()
    assert plain["reused_tokens"] == 0
    # reuse covers most of what re-encoding encodes (identical contexts: once either way)
    assert stats["reused_tokens"] > 0.8 * plain["prefill_tokens"]
    assert stats["prefill_tokens"] < 0.2 * plain["prefill_tokens"]
    assert stats["kv_not_stored"] == 0


def test_identical_contexts_sample_independently(tiny):
    sampler = TransformersSampler(*tiny, kv_reuse_gb=1.0)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, stop=())
    samples = sampler.sample([PREAMBLE] * 8, params, seed=0)
    assert len({tuple(s.token_ids) for s in samples}) > 1  # one encoding, eight draws
    assert sampler.stats()["prefill_tokens"] == len(PREAMBLE)  # encoded once


def test_loading_weights_drops_stored_keys(tiny):
    model, tokenizer = tiny
    reuse = TransformersSampler(model, tokenizer, kv_reuse_gb=1.0)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, stop=())
    first = reuse.sample(CONTEXTS, params, seed=0)
    contexts = [c + s.token_ids + [300] for c, s in zip(CONTEXTS, first, strict=True)]

    original = {k: v.clone() for k, v in model.state_dict().items()}
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in original.items()}
    try:
        reuse.load_weights(new)
        before = reuse.stats()["prefill_tokens"]
        after = reuse.sample(contexts, params, seed=1)
        # the old policy's keys were dropped: every distinct context re-encodes what follows
        # the preamble (question, sampled tokens, observation), and the preamble is encoded
        # anew, once
        encoded = reuse.stats()["prefill_tokens"] - before
        distinct = {tuple(c) for c in contexts}
        assert encoded == len(PREAMBLE) + sum(len(c) - len(PREAMBLE) for c in distinct)
        expected = TransformersSampler(model, tokenizer, kv_reuse_gb=0).sample(
            contexts, params, seed=1
        )
        assert_same([after], [expected])
    finally:
        model.load_state_dict(original)


def test_over_budget_rows_are_not_stored_and_are_counted(tiny):
    fresh = TransformersSampler(*tiny, kv_reuse_gb=0)
    tight = TransformersSampler(*tiny, kv_reuse_gb=1e-9)
    assert_same(rollout(fresh), rollout(tight))
    assert tight.stats()["kv_not_stored"] > 0
    assert tight.stats()["reused_tokens"] == 0


def test_bad_budget_is_rejected(tiny):
    with pytest.raises(ValueError, match="kv_reuse_gb must be >= 0"):
        TransformersSampler(*tiny, kv_reuse_gb=-1)


def test_inverse_cdf_draw_matches_the_filtered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]]).expand(40000, 5).contiguous()
    generator = torch.Generator().manual_seed(0)
    for params, support in [
        (SamplingParams(temperature=1.0), 5),
        (SamplingParams(temperature=0.7, top_k=2), 2),
        # probabilities 0.61, 0.22, 0.14, 0.03, 0.004: mass before the 4th is 0.965 > 0.85
        (SamplingParams(temperature=1.0, top_p=0.85), 3),
    ]:
        chosen, logp = _pick(logits, params, generator)
        scaled = logits[0] / params.temperature
        probs = torch.softmax(scaled[:support], dim=-1)  # renormalised over the kept tokens
        counts = torch.bincount(chosen, minlength=5).double() / len(chosen)
        assert counts[support:].sum() == 0, "a filtered-out token was drawn"
        assert torch.allclose(counts[:support], probs.double(), atol=0.01), (counts, probs)
        # behavior log-probs are of the unfiltered tempered distribution
        full = torch.log_softmax(scaled, dim=-1)
        assert torch.allclose(logp, full[chosen], atol=1e-6)
