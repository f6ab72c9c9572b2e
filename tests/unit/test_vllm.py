"""The vLLM backend on a real engine (vLLM's CPU build here): SmolLM2 in float32.

Behaviour log-probs against a teacher-forced forward of the same weights, seeds, the
prefix cache, weights loaded in place (against the transformers model on the same
weights; against a fresh engine built from them in the second test command), refusals,
and, in the second test command too, the generator's token bookkeeping with
``backend="vllm"``.
"""

from __future__ import annotations

import time

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

torch = pytest.importorskip("torch")

from ray_credit.actors.generator import Generator, GeneratorConfig  # noqa: E402
from ray_credit.actors.sampling import SamplingParams, TransformersSampler  # noqa: E402
from ray_credit.models import load_model  # noqa: E402
from tests.unit.test_generator import QUESTIONS, WordRetriever  # noqa: E402

T = 0.8
PARAMS = SamplingParams(max_new_tokens=24, temperature=T, top_p=0.95, stop=("</search>",))
GREEDY = SamplingParams(max_new_tokens=16, temperature=0)


def _engine(model: str = "smollm2-135m", **kwargs):
    from ray_credit.actors.sampling import VLLMConfig, VLLMSampler

    return VLLMSampler(model, config=VLLMConfig(kv_cache_gb=1), max_model_len=2048, **kwargs)


@pytest.fixture(scope="module")
def engine():
    return _engine()


@pytest.fixture(scope="module")
def hf():
    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def prompt(engine):
    # long enough to span several of the engine's cache blocks
    text = "Facts: Velmora was founded by Ada Quill. " * 40 + "Question: who founded Velmora?"
    return engine.tokenizer.encode(text + "\n<search>")


def _teacher_forced(model, context: list[int], ids: list[int], temperature: float):
    full = torch.tensor([context + ids])
    with torch.inference_mode():
        logits = model(full).logits[0, len(context) - 1 : -1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(ids)[:, None])[:, 0]


def test_behaviour_logprobs_match_teacher_forcing_over_two_turns(engine, hf, prompt):
    """The learner's log_softmax(logits / T) before top-p truncation, in float32: single
    turn, then a second turn over context + sampled ids + observation ids."""
    model, tokenizer = hf
    rows = [prompt] * 3  # each row a teacher-forced forward of SmolLM2 per turn
    first = engine.sample(rows, PARAMS, seed=11)
    observation = tokenizer.encode("\n<information>Ada Quill founded it.</information>\n")
    contexts = [prompt + turn.token_ids + observation for turn in first]
    second = engine.sample(contexts, PARAMS, seed=12)
    worst = {"single": 0.0, "multi": 0.0}
    for key, ctxs, turns in (("single", rows, first), ("multi", contexts, second)):
        for context, turn in zip(ctxs, turns, strict=True):
            assert len(turn.token_ids) == len(turn.logprobs) > 0
            expected = _teacher_forced(model, context, turn.token_ids, T)
            diff = (expected - torch.tensor(turn.logprobs)).abs().max().item()
            worst[key] = max(worst[key], diff)
    print(f"vLLM vs teacher-forced behaviour log-probs, max |diff|: {worst}")
    assert worst["single"] < 1e-3 and worst["multi"] < 1e-3


def test_greedy_equals_the_transformers_sampler(engine, hf, prompt):
    ours = engine.sample([prompt], GREEDY, seed=0)[0]
    theirs = TransformersSampler(*hf, kv_reuse_gb=0).sample([prompt], GREEDY, seed=0)[0]
    assert ours.token_ids == theirs.token_ids
    assert ours.logprobs == pytest.approx(theirs.logprobs, abs=1e-3)
    assert ours.hit_limit == theirs.hit_limit


def test_seeds_reproduce_calls_and_separate_rows(engine, prompt):
    rows = [prompt] * 6
    first = [t.token_ids for t in engine.sample(rows, PARAMS, seed=5)]
    again = [t.token_ids for t in engine.sample(rows, PARAMS, seed=5)]
    other = [t.token_ids for t in engine.sample(rows, PARAMS, seed=6)]
    assert first == again
    assert len({tuple(ids) for ids in first}) >= 4  # G copies of one prompt differ
    assert first != other


def test_turns_reuse_the_prefix_cache_and_count_it(engine, prompt):
    before = engine.stats()
    turns = engine.sample([prompt] * 4, PARAMS, seed=21)
    engine.sample([prompt + t.token_ids + [198] for t in turns], PARAMS, seed=22)
    after = engine.stats()
    reused = after["reused_tokens"] - before["reused_tokens"]
    encoded = after["prefill_tokens"] - before["prefill_tokens"]
    prompt_tokens = 4 * len(prompt) + sum(len(prompt) + len(t.token_ids) + 1 for t in turns)
    assert reused + encoded == prompt_tokens
    assert reused >= 7 * (len(prompt) // 2)  # all but the first copy, both turns: most of it


def test_stop_strings_end_a_turn_and_stay_in_its_ids(engine, prompt):
    turns = engine.sample([prompt] * 6, PARAMS, seed=31)
    for turn in turns:
        text = engine.tokenizer.decode(turn.token_ids)
        if "</search>" in text:
            assert text.rstrip().endswith("</search>") and not turn.hit_limit
        elif turn.token_ids[-1] != engine.eos_token_id:
            assert turn.hit_limit and len(turn.token_ids) == PARAMS.max_new_tokens


def _perturbed(model):
    generator = torch.Generator().manual_seed(0)
    return {
        name: value + 0.02 * torch.randn(value.shape, generator=generator)
        if value.dim() == 2
        else value.clone()
        for name, value in model.state_dict().items()
    }


def test_weights_load_in_place_like_the_transformers_model(engine, hf, prompt):
    """New weights change the samples, and greedy output is the transformers sampler's
    on the same weights; a wrong-shaped publication is refused and changes nothing."""
    from ray_credit.actors.generator import _weights_dtype

    model, tokenizer = hf
    assert engine.dtype == _weights_dtype(engine) == "float32"  # what it is published in
    old = engine.sample([prompt], GREEDY, seed=0)[0].token_ids
    base = {name: value.clone() for name, value in model.state_dict().items()}
    weights = _perturbed(model)
    bad = dict(weights)
    bad["model.norm.weight"] = torch.ones(7)
    with pytest.raises(ValueError, match="shape mismatches"):
        engine.load_weights(bad)
    assert engine.sample([prompt], GREEDY, seed=0)[0].token_ids == old  # untouched
    start = time.perf_counter()
    engine.load_weights(weights)
    print(f"vLLM in-place weight load (SmolLM2-135M, float32): {time.perf_counter() - start:.2f} s")
    try:
        new = engine.sample([prompt], GREEDY, seed=0)[0]
        assert new.token_ids != old
        model.load_state_dict(weights)
        theirs = TransformersSampler(model, tokenizer, kv_reuse_gb=0).sample(
            [prompt], GREEDY, seed=0
        )[0]
        assert new.token_ids == theirs.token_ids
        assert new.logprobs == pytest.approx(theirs.logprobs, abs=1e-3)
    finally:
        model.load_state_dict(base)
        engine.load_weights(base)  # back to the base weights for other tests
    assert engine.sample([prompt], GREEDY, seed=0)[0].token_ids == old


@pytest.mark.e2e  # a second engine: the second test command
def test_weights_load_in_place_like_a_fresh_engine(engine, hf, prompt, tmp_path):
    """Greedy output and seeded samples after an in-place load equal a fresh engine's
    built from the same weights saved as a learner checkpoint's policy folder."""
    model, _ = hf
    weights = _perturbed(model)
    engine.load_weights(weights)
    try:
        new = engine.sample([prompt], GREEDY, seed=0)[0].token_ids
        # the fresh engine reads the policy folder of a learner checkpoint, as saved in a run
        from ray_credit.actors.learner import Learner, LearnerConfig

        learner = Learner(load_model("smollm2-135m"), LearnerConfig())
        learner.model.load_state_dict(weights)
        learner.save(tmp_path / "checkpoint")
        del learner
        fresh = _engine(str(tmp_path / "checkpoint" / "model"))
        assert fresh.sample([prompt], GREEDY, seed=0)[0].token_ids == new
        # and sampling agrees too: same weights, same seeds, same tokens
        rows = [prompt] * 3
        assert [t.token_ids for t in fresh.sample(rows, PARAMS, seed=9)] == [
            t.token_ids for t in engine.sample(rows, PARAMS, seed=9)
        ]
    finally:
        engine.load_weights(model.state_dict())  # back to the base weights for other tests


def test_contexts_longer_than_the_engine_are_refused(engine):
    with pytest.raises(ValueError, match="max_model_len"):
        engine.sample([[1] * 2048], PARAMS, seed=0)


@pytest.mark.e2e  # two more engines (tiny-random): the second test command
def test_generator_with_the_vllm_backend_keeps_its_token_bookkeeping():
    """Multi-turn rollouts through vLLM: sampled ids carry loss_mask 1 and the behaviour
    log-probs of a teacher-forced forward; observation ids are appended with mask 0;
    versions and prefix-cache counters are recorded."""
    config = GeneratorConfig(
        group_size=3, max_turns=3, max_new_tokens=12, temperature=1.0, seed=3, backend="vllm"
    )
    generator = Generator("tiny-random", WordRetriever(), config)
    batch = generator.generate(QUESTIONS)
    assert len(batch) == 6 and batch.num_groups == 2
    model, _ = load_model("tiny-random")
    worst, sampled_ids = 0.0, set()
    for row in batch.to_records():
        ids, mask = row["input_ids"], row["loss_mask"]
        logprobs = torch.tensor(row["behavior_logprobs"])
        assert len(ids) == len(mask) == len(logprobs) == len(row["token_turn"])
        assert all(lp == 0 for lp, m in zip(row["behavior_logprobs"], mask, strict=True) if not m)
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        on = torch.tensor(mask[1:], dtype=torch.bool)
        worst = max(worst, (expected[on] - logprobs[1:][on]).abs().max().item())
        sampled_ids.add(tuple(i for i, m in zip(ids, mask, strict=True) if m))
        assert all(turn["policy_version"] == 0 for turn in row["turns"])
    assert worst < 1e-3
    assert len(sampled_ids) > 1
    assert batch.metrics["gen/generated_tokens"] > 0
    assert batch.metrics["gen/reused_tokens"] > 0  # later turns read the prefix cache
    assert generator.update_weights(1, model.state_dict()) == 1
    later = generator.generate(QUESTIONS[:1])
    assert {turn["policy_version"] for row in later.to_records() for turn in row["turns"]} == {1}
    assert later.metrics["gen/weight_load_seconds"] > 0
    # a new generator with the same seed and name rolls out the same tokens (made last:
    # in-process engines share vLLM's parallel state, and one engine's teardown ends it)
    again = Generator("tiny-random", WordRetriever(), config, name=generator.name)
    assert again.generate(QUESTIONS).column("input_ids").to_pylist() == (
        batch.column("input_ids").to_pylist()
    )
