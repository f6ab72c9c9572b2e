"""The learner's memory settings, run for real on CPU with tiny-random: LoRA through peft
(adapters trained, merged weights published, saved and resumed), gradient checkpointing
(the same update with less memory) and the attention kernel (the same log-probs)."""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from ray_credit.actors.learner import Learner, LearnerConfig  # noqa: E402
from ray_credit.actors.lora import LoraConfig, merged_state_dict  # noqa: E402
from ray_credit.models import load_model  # noqa: E402
from tests.unit.test_learner import GradRecorder, batch  # noqa: E402, F401 (fixture)

LORA = LoraConfig(rank=4, alpha=8.0)


def _lora_learner(**changes):
    config = LearnerConfig(lr=1e-2, **{"lora": LORA, **changes})
    return Learner(load_model("tiny-random"), config)


def _logits(model, text_ids=(1, 5, 9, 13, 2, 7)):
    with torch.no_grad():
        return model(torch.tensor([list(text_ids)])).logits


def test_lora_trains_only_the_adapters_and_publishes_merged_weights(batch):  # noqa: F811
    base = {k: v.clone() for k, v in load_model("tiny-random")[0].state_dict().items()}
    learner = _lora_learner()
    trained = {n for n, p in learner.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n for n in trained)
    held = {id(p) for group in learner.optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for n, p in learner.model.named_parameters() if n in trained}
    # before training the adapters add nothing: the published weights are the base's
    published = learner.get_weights()
    assert published.keys() == base.keys()
    assert max(float((published[k] - base[k]).abs().max()) for k in base) == 0.0

    learner.train(batch)
    published = learner.get_weights()
    assert published.keys() == base.keys()  # the base model's names: what vLLM loads
    moved = [k for k in base if not torch.equal(published[k], base[k])]
    assert moved and all(k.endswith(".weight") and "proj" in k for k in moved)
    # the merged weights are peft's own merge of the same adapters
    reference = copy.deepcopy(learner.model).merge_and_unload()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(published[name], value, rtol=0, atol=1e-6)
    # and a plain model holding them computes what the adapted model computes
    plain = load_model("tiny-random")[0]
    plain.load_state_dict(published)
    torch.testing.assert_close(_logits(plain), _logits(learner.model), rtol=1e-5, atol=1e-5)


def test_merge_scales_by_alpha_over_rank():
    lora = LoraConfig(rank=2, alpha=6.0)
    weight = torch.zeros(3, 4)
    down, up = torch.ones(2, 4), torch.full((3, 2), 0.5)
    state = {
        "base_model.model.layer.base_layer.weight": weight,
        "base_model.model.layer.base_layer.bias": torch.ones(3),
        "base_model.model.layer.lora_A.default.weight": down,
        "base_model.model.layer.lora_B.default.weight": up,
        "base_model.model.norm.weight": torch.ones(4),
    }
    merged = merged_state_dict(state, lora)
    assert sorted(merged) == ["layer.bias", "layer.weight", "norm.weight"]
    torch.testing.assert_close(merged["layer.weight"], torch.full((3, 4), 3.0))  # 6/2 * 1


def test_a_lora_checkpoint_is_a_plain_model_folder_and_resumes_the_adapters(
    batch,  # noqa: F811
    tmp_path,
):
    from transformers import AutoModelForCausalLM

    config = LearnerConfig(lr=1e-2, lora=LORA, mini_batches=2, kl_coef=0.1)
    learner = Learner(load_model("tiny-random"), config)
    learner.train(batch)
    learner.save(tmp_path / "ckpt")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "model").eval()
    torch.testing.assert_close(_logits(plain), _logits(learner.model), rtol=1e-5, atol=1e-5)
    assert (tmp_path / "ckpt" / "adapter.safetensors").is_file()
    learner.train(batch)

    # resumed over the base model (as LearnerGroup does under LoRA), never the merged one
    resumed = Learner(load_model("tiny-random"), config)
    resumed.load_state(tmp_path / "ckpt")
    resumed.train(batch)
    after, again = learner.get_weights(), resumed.get_weights()
    assert max(float((after[k] - again[k]).abs().max()) for k in after) < 1e-6

    with pytest.raises(ValueError, match="different learner config"):
        Learner(load_model("tiny-random"), replace(config, lora=LoraConfig())).load_state(
            tmp_path / "ckpt"
        )
    (tmp_path / "ckpt" / "adapter.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="saved without LoRA adapters"):
        Learner(load_model("tiny-random"), config).load_state(tmp_path / "ckpt")


def test_lora_kl_is_to_the_base_model_with_adapters_off(batch):  # noqa: F811
    learner = _lora_learner(kl_coef=0.5)
    assert learner.reference is None  # no second copy of the model
    first = learner.train(batch)
    assert first["learner/kl"] == pytest.approx(0.0, abs=1e-7)  # B = 0: policy = base
    second = learner.train(batch)
    assert second["learner/kl"] > 0  # the adapters moved it from the base


def test_lora_settings_are_checked():
    with pytest.raises(ValueError, match="rank must be >= 0"):
        LoraConfig(rank=-1)
    with pytest.raises(ValueError, match="alpha must be a positive finite"):
        LoraConfig(rank=4, alpha=0.0)
    with pytest.raises(ValueError, match="already names every linear layer"):
        LoraConfig(rank=4, target_modules=("all-linear", "q_proj"))
    with pytest.raises(ValueError, match="target_modules=.*no_such_proj"):
        _lora_learner(lora=LoraConfig(rank=4, target_modules=("no_such_proj",)))


def test_gradient_checkpointing_gives_the_same_update(batch):  # noqa: F811
    config = LearnerConfig(lr=1e-3, share_prefix=False, shuffle=False)
    plain = GradRecorder(load_model("tiny-random"), config)
    saving = GradRecorder(load_model("tiny-random"), replace(config, gradient_checkpointing=True))
    assert saving.model.is_gradient_checkpointing and saving.model.training
    m_plain, m_saving = plain.train(batch), saving.train(batch)
    for name, grad in plain.grads.items():
        torch.testing.assert_close(saving.grads[name], grad, rtol=1e-4, atol=1e-6)
    assert m_saving["learner/pg_loss"] == pytest.approx(m_plain["learner/pg_loss"], rel=1e-5)
    with pytest.raises(ValueError, match="set share_prefix false with it"):
        LearnerConfig(gradient_checkpointing=True)


def test_the_attention_kernel_is_set_and_changes_no_log_prob():
    eager, _ = load_model("tiny-random", attn_implementation="eager")
    sdpa, _ = load_model("tiny-random", attn_implementation="sdpa")
    assert eager.config._attn_implementation == "eager"
    assert sdpa.config._attn_implementation == "sdpa"
    torch.testing.assert_close(_logits(eager), _logits(sdpa), rtol=1e-5, atol=1e-5)
    learner = Learner("tiny-random", LearnerConfig(attn_implementation="eager"))
    assert learner.model.config._attn_implementation == "eager"
    with pytest.raises((TypeError, ValueError), match="attn_implementation"):
        LearnerConfig(attn_implementation="fast")
    assert np.isfinite(float(_logits(eager).sum()))


def test_the_transformers_generator_takes_the_attention_kernel_too():
    from ray_credit.actors.generator import Generator, GeneratorConfig
    from tests.unit.test_generator import QUESTIONS, WordRetriever

    rows = {}
    for kernel in ("eager", "sdpa"):
        config = GeneratorConfig(
            group_size=2, max_turns=2, max_new_tokens=8, temperature=0.0, seed=1,
            attn_implementation=kernel,
        )  # fmt: skip
        generator = Generator("tiny-random", WordRetriever(), config)
        assert generator.sampler.model.config._attn_implementation == kernel
        rows[kernel] = [r["input_ids"] for r in generator.generate(QUESTIONS).to_records()]
    assert rows["eager"] == rows["sdpa"]  # greedy: the same tokens whichever kernel
