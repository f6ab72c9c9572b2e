"""The learner: loss aggregation over micro-batches, update direction, KL reference,
off-policy corrections, non-finite gradients, schedules and checkpoints."""

from __future__ import annotations

import contextlib
import pickle
from dataclasses import replace
from functools import partial

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ray_credit.actors.generator import Generator, GeneratorConfig  # noqa: E402
from ray_credit.actors.learner import Learner, LearnerConfig, _prompt_keys  # noqa: E402
from ray_credit.losses import AGG_MODES, PolicyLossConfig, agg_loss  # noqa: E402
from ray_credit.models import load_model  # noqa: E402
from tests.unit.test_generator import QUESTIONS, WordRetriever  # noqa: E402


@pytest.fixture(scope="module")
def batch():
    """Real rollouts of tiny-random with fixed, nonzero advantages per turn."""
    config = GeneratorConfig(group_size=3, max_turns=2, max_new_tokens=10, seed=1)
    rollouts = Generator(load_model("tiny-random"), WordRetriever(), config).generate(QUESTIONS)
    advantages = np.random.default_rng(0).normal(size=rollouts.num_turns).astype(np.float32)
    return rollouts.with_turn_columns({"turn_advantages": advantages})


def _learner(config=None, **kwargs):
    return Learner(load_model("tiny-random"), config or LearnerConfig(lr=1e-3), **kwargs)


def _weights(learner):
    return {k: v.clone() for k, v in learner.model.state_dict().items()}


def _max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _sequence_logprob(learner, batch, row):
    record = batch.to_records()[row]
    ids = torch.tensor(record["input_ids"])[None]
    with torch.no_grad():
        logp = torch.log_softmax(learner.model(ids).logits[0, :-1].float(), -1)
    picked = logp.gather(-1, ids[0, 1:, None])[:, 0]
    return float((picked * torch.tensor(record["loss_mask"][1:])).sum())


@pytest.mark.parametrize("mode", AGG_MODES)
def test_token_weights_sum_to_each_aggregation_mode(mode):
    loss = PolicyLossConfig(agg_mode=mode)
    learner = _learner(LearnerConfig(lr=1e-3, loss=loss))
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(5, 9, generator=gen)
    mask = (torch.rand(5, 9, generator=gen) > 0.4).float()
    mask[2] = 0  # an empty row
    weighted = (values * learner._token_weights(mask)).sum()
    torch.testing.assert_close(weighted, agg_loss(values, mask, mode), rtol=1e-6, atol=1e-7)


class GradRecorder(Learner):
    """Keeps a copy of the accumulated gradients of each optimizer step."""

    def _clip_and_step(self):
        self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters()}
        return super()._clip_and_step()


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_give_the_same_gradient(batch, mode):
    loss = PolicyLossConfig(agg_mode=mode)
    config = LearnerConfig(lr=1e-3, loss=loss, micro_batch_tokens=10**6)
    whole = GradRecorder(load_model("tiny-random"), config)
    split = GradRecorder(
        load_model("tiny-random"), LearnerConfig(**{**config.__dict__, "micro_batch_tokens": 1})
    )
    assert len(list(split._micro_batches(torch.full((6,), 30)))) == 6  # one row per pass
    m_whole, m_split = whole.train(batch), split.train(batch)
    for name, grad in whole.grads.items():
        torch.testing.assert_close(split.grads[name], grad, rtol=1e-4, atol=1e-8)
    assert m_whole["learner/loss"] == pytest.approx(m_split["learner/loss"], abs=1e-6)
    assert m_whole["learner/grad_norm"] == pytest.approx(m_split["learner/grad_norm"], rel=1e-5)


def test_update_follows_the_advantage_sign(batch):
    """A positive advantage on every turn raises the sampled tokens' logprob; negative lowers it."""
    for sign in (1.0, -1.0):
        signed = batch.with_turn_columns(
            {"turn_advantages": np.full(batch.num_turns, sign, np.float32)}
        )
        learner = _learner(LearnerConfig(lr=1e-2, max_grad_norm=None))
        before = [_sequence_logprob(learner, signed, r) for r in range(len(signed))]
        metrics = learner.train(signed)
        after = [_sequence_logprob(learner, signed, r) for r in range(len(signed))]
        moved = np.sign(np.array(after) - np.array(before))
        assert (moved == sign).mean() >= 5 / 6, (sign, before, after)
        assert metrics["learner/policy_version"] == 1 and learner.policy_version == 1
        assert metrics["learner/optimizer_steps"] == 1
        # On-policy: ratio 1 up to float rounding, nothing clipped on the first step.
        assert metrics["learner/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
        assert metrics["learner/clipfrac"] == 0.0


def test_epochs_and_mini_batches_count_optimizer_steps(batch):
    learner = _learner(LearnerConfig(lr=1e-3, epochs=2, mini_batches=3))
    metrics = learner.train(batch)
    assert metrics["learner/optimizer_steps"] == 6
    assert learner.policy_version == 1  # one published update per batch
    assert metrics["learner/clipfrac"] >= 0.0 and metrics["learner/approx_kl"] != 0.0


def test_gradients_are_freed_after_each_optimizer_step(batch):
    learner = GradRecorder(load_model("tiny-random"), LearnerConfig(lr=1e-3, mini_batches=2))
    learner.train(batch)
    assert any(g.abs().sum() > 0 for g in learner.grads.values())  # there was a gradient
    assert all(p.grad is None for p in learner.model.parameters())  # and none is held now
    before = _weights(learner)
    learner.train(batch)  # the next update accumulates from zero, as before
    assert any(not torch.equal(before[k], v) for k, v in learner.model.state_dict().items())


def test_kl_reference_only_when_asked(batch):
    assert _learner().reference is None  # kl_coef = 0: no reference model in memory
    learner = _learner(LearnerConfig(lr=1e-2, kl_coef=0.5, epochs=2, mini_batches=2))
    assert learner.reference is not None
    reference = {k: v.clone() for k, v in learner.reference.state_dict().items()}
    metrics = learner.train(batch)
    assert metrics["learner/kl"] > 0.0  # the policy moved away within the update
    assert _max_diff(reference, learner.reference.state_dict()) == 0.0  # frozen


def test_an_fsdp_reference_is_resharded_after_its_pass(batch):
    """Under FSDP a frozen model's forward (the KL reference) leaves the root module's own
    parameters (the embeddings) gathered, for a backward that never comes: the learner
    reshards it, so the reference holds its shard alone between updates."""
    from torch.distributed.tensor import DTensor

    from ray_credit.actors.learner import TorchFSDP
    from ray_credit.testing import process_group_of_one

    with process_group_of_one("gloo"):
        learner = _learner(LearnerConfig(lr=1e-3, kl_coef=0.1), world=TorchFSDP())
        metrics = learner.train(batch)
        assert metrics["learner/kl"] >= 0.0
        whole = [n for n, p in learner.reference.named_parameters() if not isinstance(p, DTensor)]
        assert whole == []


def test_off_policy_corrections(batch):
    """On-policy data: every correction is the identity. Stale behavior logprobs: the
    truncated/excluded tokens are counted."""
    grads = {}
    for mode in ("none", "tis", "decoupled"):
        learner = GradRecorder(load_model("tiny-random"), LearnerConfig(lr=1e-3, off_policy=mode))
        metrics = learner.train(batch)
        grads[mode] = learner.grads
        if mode != "none":
            assert metrics["learner/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
            assert metrics["learner/is_limited_frac"] == 0.0
    for mode in ("tis", "decoupled"):
        for name, grad in grads["none"].items():
            torch.testing.assert_close(grads[mode][name], grad, rtol=1e-3, atol=1e-7)

    # Behavior logprobs 2 nats lower than the proximal policy's: weights e^2 > cap 2.
    records = batch.to_records()
    for r in records:
        r["behavior_logprobs"] = [
            lp - 2.0 * m for lp, m in zip(r["behavior_logprobs"], r["loss_mask"], strict=True)
        ]
    stale = type(batch).from_records(records)
    for mode in ("tis", "decoupled"):
        metrics = _learner(LearnerConfig(lr=1e-3, off_policy=mode)).train(stale)
        assert metrics["learner/is_limited_frac"] == 1.0, mode
        expected = 2.0 if mode == "tis" else 0.0
        assert metrics["learner/is_weight_mean"] == pytest.approx(expected, abs=1e-5), mode


def test_one_optimizer_step_takes_its_proximal_log_probs_from_its_own_forward(batch, monkeypatch):
    """With one optimizer step per update the step's forward runs on the weights the
    update starts from: its log-probs, detached, are the proximal ones, and no pass of
    their own is run (a whole forward over the batch saved). With two mini-batches the
    second steps on moved weights: one pass before the update gives them."""
    from ray_credit.actors.learner import Learner

    calls = []
    original = Learner._logprobs_no_grad

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Learner, "_logprobs_no_grad", counted)
    metrics = _learner(LearnerConfig(lr=1e-3, off_policy="tis")).train(batch)
    assert calls == [] and metrics["learner/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["learner/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    metrics = _learner(LearnerConfig(lr=1e-3, off_policy="tis", mini_batches=2)).train(batch)
    assert calls == [1] and metrics["learner/optimizer_steps"] == 2


def test_nonfinite_gradient_skips_the_step_and_is_counted(batch):
    # A batch refuses inf advantages (with_turn_columns validates), but the largest finite
    # float32 advantage still overflows the gradient's sums to inf.
    huge = np.full(batch.num_turns, np.finfo(np.float32).max, np.float32)
    bad = batch.with_turn_columns({"turn_advantages": huge})
    learner = _learner()
    before = _weights(learner)
    metrics = learner.train(bad)
    assert metrics["learner/nonfinite_grad_steps"] == 1
    assert metrics["learner/optimizer_steps"] == 0
    assert _max_diff(before, _weights(learner)) == 0.0


def test_lr_schedules():
    config = LearnerConfig(lr=1.0, warmup_steps=3, lr_schedule="cosine", total_steps=13)
    assert [config.lr_at(s) for s in range(3)] == pytest.approx([0.25, 0.5, 0.75])
    assert config.lr_at(3) == pytest.approx(1.0)
    assert config.lr_at(8) == pytest.approx(0.5)
    assert config.lr_at(13) == pytest.approx(0.0, abs=1e-12)
    linear = LearnerConfig(lr=2.0, lr_schedule="linear", total_steps=4, min_lr_ratio=0.5)
    assert [linear.lr_at(s) for s in range(5)] == pytest.approx([2.0, 1.75, 1.5, 1.25, 1.0])
    with pytest.raises(ValueError, match="total_steps"):
        LearnerConfig(lr_schedule="cosine")
    with pytest.raises(ValueError, match="off_policy must be one of"):
        LearnerConfig(off_policy="ppo")
    with pytest.raises(ValueError, match="is_cap must be a finite number > 1"):
        LearnerConfig(is_cap=0.5)


def test_checkpoint_resumes_the_same_trajectory_of_updates(batch, tmp_path):
    config = LearnerConfig(lr=1e-3, warmup_steps=2, mini_batches=2, kl_coef=0.1)
    learner = _learner(config)
    learner.train(batch)
    learner.save(tmp_path / "ckpt")
    # the saved policy is a plain Hugging Face folder: transformers loads it as it is
    from transformers import AutoModelForCausalLM, AutoTokenizer

    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "model").eval()
    ids = AutoTokenizer.from_pretrained(tmp_path / "ckpt" / "model")("Who founded it?")
    ids = torch.tensor([ids["input_ids"]])
    with torch.no_grad():
        assert torch.allclose(plain(ids).logits, learner.model(ids).logits, atol=1e-5)
    learner.train(batch)

    resumed = Learner(str(tmp_path / "ckpt" / "model"), config)
    resumed.load_state(tmp_path / "ckpt")
    assert resumed.policy_version == 1 and resumed.optimizer_steps == 2
    resumed.train(batch)
    assert _max_diff(_weights(learner), _weights(resumed)) < 1e-6
    assert resumed.scheduler.get_last_lr() == learner.scheduler.get_last_lr()

    with pytest.raises(ValueError, match="different learner config"):
        Learner(str(tmp_path / "ckpt" / "model"), LearnerConfig(lr=1e-3)).load_state(
            tmp_path / "ckpt"
        )
    (tmp_path / "ckpt" / "learner_state.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="learner_state.pt is not a learner checkpoint"):
        resumed.load_state(tmp_path / "ckpt")
    with pytest.raises(FileNotFoundError, match="not a learner checkpoint folder"):
        resumed.load_state(tmp_path)


def test_a_checkpoint_on_an_object_store_is_uploaded_and_read_back(batch):
    """To a location with no local path (pyarrow's in-memory mock:// filesystem standing in
    for s3://), the learner writes in a temporary folder and uploads it; loading downloads."""
    from ray_credit.storage import StoragePath

    learner = _learner()
    learner.train(batch)
    saved = learner.save(StoragePath("mock:///bucket/run/learner"))
    assert (saved / "model" / "config.json").is_file() and (saved / "learner_state.pt").is_file()
    with saved.as_directory() as local:
        resumed = Learner(str(local / "model"), LearnerConfig(lr=1e-3))
    resumed.load_state(saved)
    assert resumed.policy_version == 1 and _max_diff(_weights(learner), _weights(resumed)) == 0
    learner.train(batch)
    resumed.train(batch)
    assert _max_diff(_weights(learner), _weights(resumed)) < 1e-6


class _Planted:
    """Unpickling it creates ``path``: what a crafted checkpoint could do instead."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize(
    ("write", "unpickle"),
    [
        (torch.save, partial(torch.load, weights_only=False)),
        (partial(pickle.dump, protocol=2), pickle.load),
    ],
    ids=["torch.save", "pickle.dump"],
)
def test_checkpoint_that_would_run_code_is_refused_unread(tmp_path, write, unpickle):
    learner = _learner(LearnerConfig(lr=1e-3, kl_coef=0.1))
    learner.save(tmp_path / "ckpt")
    state_file = tmp_path / "ckpt" / "learner_state.pt"
    state = torch.load(state_file, weights_only=True)  # what save writes loads safely
    planted = tmp_path / "planted"
    state["counters"] = _Planted(planted)
    with state_file.open("wb") as f:
        write(state, f)

    with pytest.raises(ValueError, match=r"learner_state.pt is not a learner checkpoint"):
        learner.load_state(tmp_path / "ckpt")
    assert not planted.exists()
    with state_file.open("rb") as f:
        unpickle(f)  # the file is live: a full unpickle runs it
    assert planted.exists()


def test_dtype_holds_the_policy_and_the_reference():
    learner = Learner("tiny-random", LearnerConfig(lr=1e-3, kl_coef=0.1, dtype="bfloat16"))
    assert {p.dtype for p in learner.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in learner.reference.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="dtype must be one of"):
        LearnerConfig(dtype="bf16")


def test_weights_published_in_a_bf16_generators_dtype_load_as_it_would_round_them(batch):
    """A bf16 generator gets the learner's float32 weights cast to bf16 (half the bytes):
    it then holds exactly what it would have rounded them to itself."""
    from ray_credit.pipeline.weights import common_dtype

    learner = _learner()
    learner.train(batch)
    full, half = learner.get_weights(), learner.get_weights("bfloat16")
    assert {v.dtype for v in half.values()} == {torch.bfloat16} and full.keys() == half.keys()
    assert sum(v.nbytes for v in half.values()) * 2 == sum(v.nbytes for v in full.values())
    config = GeneratorConfig(group_size=2, max_turns=1, max_new_tokens=4)
    pair = [load_model("tiny-random", dtype="bfloat16") for _ in range(2)]
    rounding, given = (Generator(p, WordRetriever(), config) for p in pair)
    assert rounding.weights_dtype() == given.weights_dtype() == "bfloat16"
    rounding.update_weights(1, full)
    given.update_weights(1, half)
    for name, value in rounding.sampler.model.state_dict().items():
        assert torch.equal(value, given.sampler.model.state_dict()[name]), name
    assert common_dtype(["bfloat16", "bfloat16"]) == "bfloat16"
    assert common_dtype(["bfloat16", "float32"]) is None  # one would lose precision
    assert common_dtype(["float32"]) is common_dtype([None]) is None
    with pytest.raises(ValueError, match="floating-point dtype, not 'int8'"):
        learner.get_weights("int8")


def test_temperature_matches_the_generators_behavior_logprobs():
    """Rollouts at T=0.7: the first on-policy ratio is 1 only when the learner divides the
    logits by the same temperature."""
    config = GeneratorConfig(group_size=3, max_turns=2, max_new_tokens=10, temperature=0.7)
    rollouts = Generator(load_model("tiny-random"), WordRetriever(), config).generate(QUESTIONS)
    rollouts = rollouts.with_turn_columns(
        {"turn_advantages": np.ones(rollouts.num_turns, dtype=np.float32)}
    )
    matched = _learner(LearnerConfig(lr=1e-3, temperature=0.7)).train(rollouts)
    assert abs(matched["learner/ratio_mean"] - 1.0) < 1e-5
    assert matched["learner/ratio_max"] < 1 + 1e-4
    mismatched = _learner(LearnerConfig(lr=1e-3)).train(rollouts)
    assert mismatched["learner/ratio_max"] > 1.05  # tiny-random's logits are near-flat
    with pytest.raises(ValueError, match="temperature must be a positive"):
        LearnerConfig(temperature=0)


def test_missing_advantages_is_a_clear_error(batch):
    plain = type(batch).from_records(
        [{k: v for k, v in r.items() if k != "turn_advantages"} for r in batch.to_records()]
    )
    with pytest.raises(Exception, match="turn_advantages"):
        _learner().train(plain)


@pytest.mark.parametrize("budget", [64, 10**6])  # several passes; one, prompts shared
def test_logprobs_of_the_trained_span_equal_a_full_forward(batch, budget):
    """Only the positions a row trains on go through the vocabulary projection, and a
    shared prompt through the model once; the log-probs there equal those of a forward
    pass over every position of each row."""
    learner = _learner(LearnerConfig(lr=1e-3, micro_batch_tokens=budget))
    tensors = batch.to_torch(pad_token_id=int(learner.tokenizer.pad_token_id))
    data = {
        "input_ids": tensors["input_ids"],
        "attention_mask": tensors["attention_mask"],
        "mask": tensors["loss_mask"][:, 1:],
        "behavior": tensors["behavior_logprobs"][:, 1:],
    }
    data["prompt_key"] = _prompt_keys(data["input_ids"], data["mask"])
    assert len(set(data["prompt_key"])) == 2  # two questions, G=3
    lengths = tensors["attention_mask"].sum(-1)
    rows = np.arange(len(batch))
    ours = learner._logprobs_no_grad(learner.model, data, lengths, rows)
    for row in rows:
        expected = _sequence_logprob(learner, batch, row)
        assert float(ours[row].sum()) == pytest.approx(expected, abs=1e-4)


def test_only_trained_positions_go_through_the_vocabulary_projection(batch, monkeypatch):
    """The observations between turns lie inside the trained span but train nothing: the
    projection to the vocabulary (and its logits) skips them, in training and in the
    log-prob passes alike, and the update still moves the weights."""
    learner = _learner(LearnerConfig(lr=1e-3, micro_batch_tokens=10**6, off_policy="tis"))
    mask = batch.to_torch(pad_token_id=0)["loss_mask"][:, 1:]
    first = int(mask.any(0).nonzero()[0])
    span = mask.shape[1] - first
    trained = int(mask.any(0).sum())
    assert trained < span  # the batch has observations between its turns
    projected = []
    head = learner.model.lm_head
    monkeypatch.setattr(
        head, "forward", lambda x, real=head.forward: projected.append(x.shape[1]) or real(x)
    )
    before = _weights(learner)
    learner.train(batch)
    # one micro-batch: its shared prompt's pass projects one position, its rows' pass the
    # trained ones
    assert projected == [1, trained]
    assert _max_diff(before, learner.model.state_dict()) > 0


def test_autocast_trains_float32_weights_near_the_float32_update(batch):
    """bf16 autocast: the weights stay float32, and one update moves them as float32 does
    up to bf16 rounding."""
    full, mixed = _learner(), _learner(LearnerConfig(lr=1e-3, autocast="bfloat16"))
    before = _weights(full)
    full.train(batch)
    mixed.train(batch)
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())
    step_full = {k: full.model.state_dict()[k] - before[k] for k in before}
    step_mixed = {k: mixed.model.state_dict()[k] - before[k] for k in before}
    flat_full = torch.cat([v.flatten() for v in step_full.values()])
    flat_mixed = torch.cat([v.flatten() for v in step_mixed.values()])
    cosine = torch.nn.functional.cosine_similarity(flat_full, flat_mixed, dim=0)
    assert cosine > 0.9, cosine
    with pytest.raises(ValueError, match="autocast"):
        LearnerConfig(autocast="int8")


def test_zero_advantages_skip_the_passes_but_not_the_optimizer_step(batch, monkeypatch):
    """All advantages 0, no KL or entropy: the update equals the full passes' (AdamW still
    steps on the zero gradient), without running them; it is counted."""
    zero = batch.with_turn_columns({"turn_advantages": np.zeros(batch.num_turns, dtype=np.float32)})
    config = LearnerConfig(lr=1e-3, weight_decay=0.1)
    warmed, full = _learner(config), _learner(config)
    for learner in (warmed, full):  # momentum from a real step first
        learner.train(batch)
    metrics = warmed.train(zero)
    every_row = lambda self, data: np.ones(len(data["advantages"]), dtype=bool)  # noqa: E731
    monkeypatch.setattr(Learner, "_rows_with_gradient", every_row)
    full.train(zero)
    assert metrics["learner/zero_gradient_batches"] == 1
    assert metrics["learner/optimizer_steps"] == 2 and metrics["learner/grad_norm"] == 0
    assert _max_diff(_weights(warmed), _weights(full)) < 1e-6
    assert _max_diff(_weights(warmed), _weights(_learner(config))) > 0  # it did move


@pytest.mark.parametrize(("mode", "mini_batches"), [("token-mean", 1), ("seq-mean-token-mean", 2)])
def test_zero_advantage_trajectories_skip_the_passes_but_keep_their_weight(
    batch, monkeypatch, mode, mini_batches
):
    """Trajectories whose advantages are all 0 are left out of the passes; the update is
    that of the full passes (they still count in the loss's normalizer), and the skipped
    trajectories are counted. With an entropy term every trajectory goes through."""
    turns = batch.turn_traj_index
    advantages = batch.turn_values("turn_advantages").copy()
    advantages[np.isin(turns, [0, 2, 3])] = 0.0  # 3 of 6 trajectories carry no advantage
    mixed = batch.with_turn_columns({"turn_advantages": advantages})
    config = LearnerConfig(
        lr=1e-3, loss=PolicyLossConfig(agg_mode=mode), mini_batches=mini_batches, shuffle=False
    )
    skipping, full = (
        GradRecorder(load_model("tiny-random"), config),
        GradRecorder(load_model("tiny-random"), config),
    )
    seen = []
    real_logits = Learner._logits
    monkeypatch.setattr(
        Learner,
        "_logits",
        lambda self, m, d, index, sl: seen.append(len(index)) or real_logits(self, m, d, index, sl),
    )
    metrics = skipping.train(mixed)
    assert sum(seen) == 3  # only the trajectories with an advantage went through
    assert metrics["learner/zero_advantage_trajectories"] == 3
    every_row = lambda self, data: np.ones(len(data["advantages"]), dtype=bool)  # noqa: E731
    monkeypatch.setattr(Learner, "_rows_with_gradient", every_row)
    seen.clear()
    full.train(mixed)
    assert sum(seen) == 6
    for name, grad in full.grads.items():
        torch.testing.assert_close(skipping.grads[name], grad, rtol=1e-4, atol=1e-6)
    # AdamW divides by sqrt(v): float rounding of near-zero gradients shows at ~1e-2 of lr
    # (1.03e-5 seen on one CPU; each step moves a weight by up to lr = 1e-3)
    assert _max_diff(_weights(skipping), _weights(full)) < 1e-4

    entropic = _learner(LearnerConfig(lr=1e-3, entropy_coef=1e-3))
    assert entropic._rows_with_gradient(
        {"advantages": torch.zeros(4, 3), "mask": torch.ones(4, 3)}
    ).all()


def test_shared_prompt_runs_once_with_the_same_gradient(batch, monkeypatch):
    """A group's rows share their prompt: it goes through the model once per micro-batch,
    and the gradient is the one of running every row whole."""
    config = LearnerConfig(lr=1e-3, micro_batch_tokens=10**6, shuffle=False)
    shared = GradRecorder(load_model("tiny-random"), config)
    whole = GradRecorder(load_model("tiny-random"), replace(config, share_prefix=False))
    calls = []
    real_forward = type(shared.model).forward

    def forward(self, input_ids=None, **kwargs):
        calls.append(tuple(input_ids.shape))
        return real_forward(self, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(type(shared.model), "forward", forward)
    m_shared = shared.train(batch)
    prompt_calls = [c for c in calls if c[0] == 1]
    assert prompt_calls and all(c[1] >= 16 for c in prompt_calls), calls
    calls.clear()
    m_whole = whole.train(batch)
    assert all(c[0] > 1 for c in calls) and len(calls) == 1
    for name, grad in whole.grads.items():
        torch.testing.assert_close(shared.grads[name], grad, rtol=1e-4, atol=1e-6)
    assert m_shared["learner/pg_loss"] == pytest.approx(m_whole["learner/pg_loss"], rel=1e-5)


def test_micro_batches_keep_a_prompt_together():
    from ray_credit.actors.learner import micro_batches

    lengths = np.array([50, 90, 60, 80, 70, 40])
    keys = np.array([0, 1, 0, 1, 0, 1])
    parts = list(micro_batches(lengths, 200, keys=keys))
    assert [p.tolist() for p in parts] == [[4, 2], [0, 1], [3, 5]]  # 0 and 1: 2 x 90 fits
    assert [p.tolist() for p in micro_batches(lengths, 200)] == [[1, 3], [4, 2], [0, 5]]


def test_an_updates_ratio_max_and_token_rate_are_the_whole_updates(batch):
    """Over epochs x mini-batches of optimizer steps, ratio_max is the largest ratio of any
    step (not a mean of the steps' maxima), and tokens/s counts each token once per epoch
    (not once per mini-batch)."""
    learner = _learner(LearnerConfig(lr=5e-2, epochs=2, mini_batches=2))
    seen = []
    step = learner._optimizer_step

    def recording(*args, **kwargs):
        out = step(*args, **kwargs)
        seen.append(out["ratio_max"])
        return out

    learner._optimizer_step = recording
    metrics = learner.train(batch)
    assert len(seen) == 4 and seen[0] < 1 + 1e-4 < max(seen)  # on-policy first, then moved
    assert metrics["learner/ratio_max"] == max(seen)
    assert metrics["learner/tokens"] == float(batch.to_torch()["loss_mask"].sum())
    rate = metrics["learner/tokens"] * 2 / metrics["learner/seconds"]
    assert metrics["learner/tokens_per_s"] == pytest.approx(rate, rel=1e-9)


@pytest.mark.parametrize(
    ("probes", "warned"), [((False, False), 1), ((True, False), 0), ((False, True), 0)]
)
def test_bfloat16_autocast_on_a_cpu_without_its_instructions_is_said_once(
    monkeypatch, probes, warned
):
    """torch emulates bfloat16 where the CPU has neither AVX512-BF16 nor AMX: an update
    took 13x as long as in float32 there, so the first autocast of a process says so."""
    from ray_credit.actors import learner as learner_module

    avx512_bf16, amx = probes
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    learner_module._warn_emulated_bf16.cache_clear()
    with _learner_log() as records:
        for _ in range(2):
            with learner_module.autocast("cpu", "bfloat16"):
                pass
        with learner_module.autocast("cpu", None):
            pass
    learner_module._warn_emulated_bf16.cache_clear()
    assert len(records) == warned
    if warned:
        assert "no AVX512-BF16, no AMX" in records[0].getMessage()
        assert "Set autocast to null" in records[0].getMessage()


@pytest.mark.parametrize(
    ("probes", "chosen"), [((False, False), None), ((True, False), "bfloat16"),
                           ((False, True), "bfloat16")],
)  # fmt: skip
def test_auto_autocast_is_bfloat16_only_where_the_cpu_has_it_and_says_so(
    monkeypatch, probes, chosen
):
    """``autocast: auto`` (the embedded default) runs bf16 on a CPU with AVX512-BF16 or
    AMX and float32 on one without (where bf16 is emulated, 13x as slow); the choice is
    logged once per process, and the emulation warning never fires for it."""
    from ray_credit.actors import learner as learner_module

    avx512_bf16, amx = probes
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    learner_module._auto_autocast.cache_clear()
    learner_module.native_bf16.cache_clear()
    learner_module._warn_emulated_bf16.cache_clear()
    with _learner_log() as records:
        assert learner_module.resolve_autocast("cpu", "auto") == chosen
        assert learner_module.resolve_autocast(torch.device("cpu"), "auto") == chosen
        assert learner_module.resolve_autocast("cpu", "float16") == "float16"
        assert learner_module.resolve_autocast("cpu", None) is None
        with learner_module.autocast("cpu", "auto"):
            assert torch.is_autocast_enabled("cpu") == (chosen is not None)
    learner_module._auto_autocast.cache_clear()
    learner_module.native_bf16.cache_clear()
    learner_module._warn_emulated_bf16.cache_clear()
    said = [r.getMessage() for r in records]
    assert len(said) == 1 and said[0].startswith("autocast 'auto': ")
    assert ("off (float32)" in said[0]) == (chosen is None)
    LearnerConfig(autocast="auto")  # a setting the config takes


@contextlib.contextmanager
def _learner_log():
    """The learner module's log records (INFO and up) while the block runs."""
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("ray_credit.actors.learner")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_the_warm_up_counts_training_steps_not_optimizer_steps(batch):
    """Two mini-batches a step: both take the step's learning rate, and the schedule moves
    once per update (verl's lr_warmup_steps_ratio is of training steps)."""
    config = LearnerConfig(lr=1e-3, warmup_steps=3, mini_batches=2)
    learner = _learner(config)
    rates = [learner.train(batch)["learner/lr"] for _ in range(4)]
    assert rates == pytest.approx([config.lr_at(s) for s in range(4)])
    assert rates == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert learner.optimizer_steps == 8


def test_a_bf16_reference_holds_half_the_bytes_and_gives_the_kl_term(batch):
    """learner.reference_dtype bfloat16 (verl holds its reference so): the frozen copy's
    parameters are bf16 while the policy's stay float32, and the KL to it is a finite,
    small term on the first update (the two start as the same weights)."""
    config = LearnerConfig(lr=1e-3, kl_coef=0.1, reference_dtype="bfloat16")
    learner = _learner(config)
    assert {p.dtype for p in learner.reference.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in learner.model.parameters()} == {torch.float32}
    f32 = _learner(LearnerConfig(lr=1e-3, kl_coef=0.1))
    size = sum(p.numel() * p.element_size() for p in learner.reference.parameters())
    assert 2 * size == sum(p.numel() * p.element_size() for p in f32.reference.parameters())
    metrics = learner.train(batch)
    assert np.isfinite(metrics["learner/kl"]) and abs(metrics["learner/kl"]) < 1e-2
