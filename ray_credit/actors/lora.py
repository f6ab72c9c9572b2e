"""LoRA for the learner, through peft: low-rank adapters are trained, merged weights are
published.

With ``LoraConfig(rank=r)`` the learner wraps its policy with peft's LoRA layers and its
optimizer holds only the adapters (2 r (d_in + d_out) numbers per adapted matrix instead
of d_in d_out: AdamW's state and the gradients shrink accordingly). Generators, the
info-gain scorer and the checkpoint's ``model/`` folder never see peft: they get the
merged weights ``W + (alpha / r) B A`` under the base model's own names
(:func:`merged_state_dict`), so a vLLM engine loads them as it loads any update, and the
saved folder loads with ``AutoModelForCausalLM.from_pretrained``. The adapters themselves
are checkpointed beside it (:func:`adapter_state_dict`) and loaded back on resume over the
base model, never by merging twice.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ray_credit.config import check_fields

__all__ = ["LoraConfig", "adapter_state_dict", "apply_lora", "base_view", "merged_state_dict"]

_PREFIX = "base_model.model."  # what peft puts before the wrapped model's names
_ADAPTER = "default"  # peft's name for the one adapter


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """Low-rank adapters instead of full fine-tuning (peft's LoRA)."""

    rank: int = 0
    """Rank r of each adapter; 0 trains every weight (no LoRA)."""
    alpha: float = 32.0
    """Scale of the update: ``alpha / rank`` times ``B A``."""
    target_modules: tuple[str, ...] = ("all-linear",)
    """Which linear layers get adapters: module names (e.g. q_proj,v_proj) or 'all-linear'
    (every linear layer but the output head)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.rank < 0:
            raise ValueError(f"rank must be >= 0 (0: no LoRA), got {self.rank}")
        if not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise ValueError(f"alpha must be a positive finite number, got {self.alpha}")
        if not self.target_modules or not all(m.strip() for m in self.target_modules):
            raise ValueError(
                f"target_modules must name at least one module (or 'all-linear'), got "
                f"{self.target_modules}"
            )
        if "all-linear" in self.target_modules and len(self.target_modules) > 1:
            raise ValueError("target_modules: 'all-linear' already names every linear layer")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def apply_lora(model: Any, config: LoraConfig) -> Any:
    """``model`` wrapped with fresh LoRA adapters (B = 0: the same outputs as before); only
    the adapters require gradients."""
    try:
        import peft
    except ImportError as err:
        raise ImportError(
            "learner.lora needs peft: pip install 'ray-credit[rollout]' (or pip install peft)"
        ) from err
    targets = config.target_modules
    peft_config = peft.LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=0.0,  # the learner's log-probs must be the sampler's
        bias="none",
        target_modules="all-linear" if targets == ("all-linear",) else list(targets),
    )
    try:
        return peft.get_peft_model(model, peft_config)
    except ValueError as err:  # peft: none of the target modules found in the model
        raise ValueError(f"learner.lora.target_modules={targets}: {err}") from None


def _base_name(name: str) -> str:
    """A peft parameter's name in the unwrapped model."""
    if name.startswith(_PREFIX):
        name = name[len(_PREFIX) :]
    return name.replace(".base_layer.", ".")


def merged_state_dict(state: Mapping[str, Any], config: LoraConfig) -> dict[str, Any]:
    """The weights a model without adapters would have, from a LoRA-wrapped model's state
    dict: ``W + scaling * B @ A`` for each adapted layer (computed in float32, stored in
    W's dtype), every other tensor as it is, all under the base model's names."""

    merged = base_view(state)
    suffix = f".lora_A.{_ADAPTER}.weight"
    for name, down in state.items():
        if not name.endswith(suffix):
            continue
        layer = name[: -len(suffix)]
        up = state[f"{layer}.lora_B.{_ADAPTER}.weight"]
        target = _base_name(f"{layer}.base_layer.weight")
        base = merged[target]
        delta = (up.float() @ down.float()) * config.scaling
        merged[target] = (base.float() + delta.to(base.device)).to(base.dtype)
    return merged


def base_view(state: Mapping[str, Any]) -> dict[str, Any]:
    """A LoRA-wrapped model's tensors under the base model's names, adapters left out
    (unmerged: for the names and shapes of what :func:`merged_state_dict` gives)."""
    return {_base_name(name): value for name, value in state.items() if ".lora_" not in name}


def adapter_state_dict(state: Mapping[str, Any]) -> dict[str, Any]:
    """The adapters' tensors of a LoRA-wrapped model's state dict (what training changed)."""
    return {name: value for name, value in state.items() if ".lora_" in name}
