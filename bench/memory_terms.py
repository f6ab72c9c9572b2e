"""What one learner update holds, term by term, measured on a CPU:

    python bench/memory_terms.py                 # about a minute on 2 cores
    python bench/memory_terms.py --out terms.json

Small models of Qwen2.5's architecture that differ in one dimension at a time (the
vocabulary, the number of layers, the intermediate width) each make two updates with
the learner's GPU settings (float32 weights under bf16 autocast, rows run whole) on one
trajectory, while a dispatch-mode tracker counts the bytes of every live tensor. From
the peaks of the second update's passes over what the first left held:

* **bytes per logit**: what the difference between two vocabularies adds per trained
  position, from two turn lengths (the projection, its float32 copy, the log-softmax,
  the entropy's temporaries and their gradients; not the embedding's gradient and bf16
  copy, which the vocabulary sizes whatever the positions);
* **bytes per token and layer**, per hidden and per intermediate unit: from the
  difference between two layer counts, at two intermediate widths;
* **autocast's copies**: what the parameters add whatever the tokens (the bf16 copies of
  the float32 weights that the matmuls save for the backward pass), over their float32
  bytes, from the two layer counts;
* **AdamW's step**: its transient over the parameters' float32 bytes.

Each model runs at two turn lengths, so that what each token adds comes apart from what
the parameters size. The gradients are kept between the updates (zeroed in place, where
the learner frees them): the estimate counts them apart.

Each is printed beside the constant :mod:`ray_credit.pipeline.memory` estimates with.
Tensors only (no allocator, no CUDA context); on a GPU some kernels keep less (fused
attention) or more, which ``bench/gpu_check.py --only scale`` measures.
"""

from __future__ import annotations

import argparse
import json
import sys
import weakref
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HIDDEN = 256
BASE = {"model_type": "qwen2", "hidden_size": HIDDEN, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": True, "hidden_act": "silu"}  # fmt: skip


class LiveBytes:
    """Counts the bytes of the tensors every torch op creates while they live, and the
    peak per phase (set ``phase``)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                from torch.utils._pytree import tree_flatten

                for value in tree_flatten(out)[0]:
                    tracker._add(value)
                return out

        self.mode = _Mode()
        self.live: dict[int, int] = {}
        self.now = 0
        self.phase = ""
        self.peaks: dict[str, int] = {}

    def _add(self, value) -> None:
        import torch

        if not isinstance(value, torch.Tensor) or value.device.type == "meta":
            return
        storage = value.untyped_storage()
        try:
            key, size = storage.data_ptr(), storage.nbytes()
        except RuntimeError:  # a storage FSDP resized to nothing
            return
        if size == 0 or key in self.live:
            return
        self.live[key] = size
        self.now += size
        weakref.finalize(storage, self._gone, key)
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), self.now)

    def _gone(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def during(self, phase: str, fn):
        def run(*args, **kwargs):
            outer, self.phase = self.phase, phase
            try:
                return fn(*args, **kwargs)
            finally:
                self.phase = outer

        return run


def update_bytes(vocab: int, layers: int, intermediate: int, *, prompt: int, turn: int) -> dict:
    """One model's second update: the passes' transient, the AdamW step's, the longest
    micro-batch's tokens and trained (logit) positions, the parameters' bytes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ray_credit.actors.learner import Learner, LearnerConfig
    from ray_credit.testing import PadOnlyTokenizer, random_batch

    batch = random_batch(0, num_groups=1, group_size=1, max_turns=1, singleton_frac=0.0,
                         prompt_tokens=prompt, tokens_per_turn=turn, vocab_size=vocab)  # fmt: skip
    batch = batch.with_turn_columns({"turn_advantages": [1.0] * batch.num_turns})
    config = LearnerConfig(lr=1e-6, autocast="bfloat16", share_prefix=False,
                           micro_batch_tokens=prompt + turn)  # fmt: skip
    arch = dict(BASE, vocab_size=vocab, num_hidden_layers=layers, intermediate_size=intermediate)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**arch), dtype=torch.float32)
    tracker = LiveBytes()
    positions = []
    with tracker.mode:
        learner = Learner((model.eval(), PadOnlyTokenizer()), config)
        logits = learner._logits
        learner._logits = lambda *a, **k: _noted(logits(*a, **k), positions)
        # the estimate counts the gradients apart: kept between the updates (zeroed in
        # place), they are in what the first update leaves held, not in the terms measured
        zero_grad = learner.optimizer.zero_grad
        learner.optimizer.zero_grad = lambda set_to_none=True: zero_grad(set_to_none=False)
        learner._optimizer_step = tracker.during("passes", learner._optimizer_step)
        learner._clip_and_step = tracker.during("optimizer", learner._clip_and_step)
        learner.train(batch)
        held, tracker.peaks = tracker.now, {}
        learner.train(batch)
    params = sum(p.numel() for p in model.parameters()) * 4
    return {"passes": tracker.peaks["passes"] - held, "optimizer": tracker.peaks["optimizer"] - held,
            "tokens": prompt + turn, "positions": max(positions), "param_bytes": params}  # fmt: skip


def _noted(projected, positions: list):
    logits, _ = projected  # (logits of the positions projected, their columns)
    positions.append(logits.shape[0] * logits.shape[1])
    return projected


def measure(*, prompt: int = 64, turn: int = 1024, vocabs=(8000, 16000), layers=(2, 6),
            intermediates=(512, 1024)) -> dict:  # fmt: skip
    """The terms (bytes), from ten updates: each model at two turn lengths, so that what
    each token (or trained position) adds comes apart from what the parameters size
    whatever the tokens (their bf16 copies under autocast)."""
    v1, v2 = vocabs
    l1, l2 = layers
    i1, i2 = intermediates

    def slopes(vocab, layers, inter):
        long = update_bytes(vocab, layers, inter, prompt=prompt, turn=turn)
        short = update_bytes(vocab, layers, inter, prompt=prompt, turn=turn // 2)
        rise = long["passes"] - short["passes"]
        per_token = rise / (long["tokens"] - short["tokens"])
        return {"per_token": per_token, "per_position": rise / (long["positions"] - short["positions"]),
                "fixed": long["passes"] - per_token * long["tokens"], "long": long}  # fmt: skip

    base = slopes(v1, l1, i1)
    wide = slopes(v2, l1, i1)
    logit = (wide["per_position"] - base["per_position"]) / (v2 - v1)
    per_layer, fixed = {}, {}
    for inter in intermediates:
        few = base if inter == i1 else slopes(v1, l1, inter)
        many = slopes(v1, l2, inter)
        per_layer[inter] = (many["per_token"] - few["per_token"]) / (l2 - l1)
        params = many["long"]["param_bytes"] - few["long"]["param_bytes"]
        fixed[inter] = (many["fixed"] - few["fixed"]) / params
    per_intermediate = (per_layer[i2] - per_layer[i1]) / (i2 - i1)
    per_hidden = (per_layer[i1] - per_intermediate * i1) / HIDDEN
    small = base["long"]
    return {
        "logit_bytes": logit,
        "layer_bytes_per_hidden": per_hidden,
        "layer_bytes_per_intermediate": per_intermediate,
        "autocast_copies_over_params": sum(fixed.values()) / len(fixed),
        "adamw_step_over_params": small["optimizer"] / small["param_bytes"],
        "per_layer_bytes": {str(k): v for k, v in per_layer.items()},
        "setup": {"hidden": HIDDEN, "prompt": prompt, "turns": [turn, turn // 2],
                  "vocabs": list(vocabs), "layers": list(layers),
                  "intermediates": list(intermediates)},
    }  # fmt: skip


def estimator_constants() -> dict:
    """What ray_credit.pipeline.memory counts for the same terms (bf16 autocast, float32
    weights)."""
    from ray_credit.pipeline import memory

    return {
        "logit_bytes": memory._LOGIT_BYTES,
        "autocast_copies_over_params": memory._AUTOCAST_COPIES,
        "layer_bytes_per_hidden": memory._LAYER_HIDDEN * 2,
        "layer_bytes_per_intermediate": memory._LAYER_INTERMEDIATE * 2,
        "adamw_step_over_params": memory._ADAMW_STEP,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "memory_terms.json"
    )
    args = parser.parse_args()
    measured = measure()
    counted = estimator_constants()
    print(f"{'term':<40} {'measured':>10} {'estimated':>10}")
    for key, value in counted.items():
        print(f"{key:<40} {measured[key]:>10.2f} {value:>10.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"measured": measured, "estimated": counted}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
