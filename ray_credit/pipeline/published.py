"""Published setups a config can say it reproduces, setting by setting, with the source
of each value, so that a run prints every place where it departs from one.

A config names one with ``reproduces: search-r1``. Before Ray starts, the run prints each
setting whose value differs from the setup's (``generator.max_turns = 3 (search-r1: 5,
...)``), and each difference that no setting expresses (:attr:`PublishedSetup.notes`);
the run's summary keeps them with the method's own departures. ``docs/search_r1.md``
lists the setup beside ``pipelines/configs/search_r1.yaml``, and a test holds the three
together.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SETUPS", "PublishedSetup", "Setting", "setup_departures"]


@dataclass(frozen=True)
class Setting:
    """One setting of a published setup: its value, in the library's terms, and where
    the value comes from."""

    value: Any
    source: str


@dataclass(frozen=True)
class PublishedSetup:
    """A paper's or project's run, as the library's settings."""

    name: str
    description: str
    settings: Mapping[str, Setting]
    """Dotted config paths (``generator.max_turns``) and their values."""
    notes: tuple[str, ...] = field(default=())
    """Differences no setting expresses: printed with the departures on every run."""


_SR1 = "Search-R1's scripts/nq_hotpotqa/v0.2/train_grpo.sh"
_SR1_VERL = "Search-R1's verl (verl/trainer/config/ppo_trainer.yaml)"
_TSPO = "the TSPO paper, Appendix B"

SEARCH_R1 = PublishedSetup(
    name="search-r1",
    description=(
        "Search-R1's GRPO run on NQ + HotpotQA with e5 over wiki-18, as the TSPO paper "
        "trains it (500 steps, G = 5, KL 1e-3, no entropy bonus)"
    ),
    settings={
        "model": Setting("Qwen/Qwen2.5-3B-Instruct", f"{_TSPO} (Qwen2.5-3B); {_SR1}, BASE_MODEL"),
        "retriever.encoder.name": Setting(
            "e5-base-v2", "Search-R1's retrieval_launch.sh (intfloat/e5-base-v2)"
        ),
        "retriever.index.kind": Setting("flat", "Search-R1's e5_Flat.index"),
        "generator.topk": Setting(3, f"{_SR1}, retriever.topk=3"),
        "generator.group_size": Setting(5, f"{_SR1}, n_agent=5; {_TSPO}, G = 5"),
        "generator.max_turns": Setting(
            5, f"{_SR1}, max_turns=4 (search turns), plus its final answer generation"
        ),
        "generator.max_new_tokens": Setting(500, f"{_SR1}, data.max_response_length=500"),
        "generator.max_observation_tokens": Setting(500, f"{_SR1}, data.max_obs_length=500"),
        "generator.max_context_tokens": Setting(4096, f"{_SR1}, data.max_prompt_length=4096"),
        "generator.temperature": Setting(1.0, f"{_SR1}, rollout.temperature=1"),
        "generator.top_p": Setting(0.95, f"{_SR1_VERL}, rollout.top_p"),
        "generator.action_style": Setting("tags", "Search-R1's <search> / <answer> protocol"),
        "generator.reward": Setting("em", "Search-R1's exact-match reward"),
        "generator.dtype": Setting("bfloat16", f"{_SR1_VERL}, rollout.dtype"),
        "learner.lr": Setting(1e-6, f"{_SR1}, actor.optim.lr=1e-6"),
        "learner.warmup_steps": Setting(
            142, f"{_SR1}, lr_warmup_steps_ratio=0.285, of the 500 training steps: int(0.285 x 500)"
        ),
        "learner.lr_schedule": Setting("constant", f"{_SR1_VERL}, warmup_style: constant"),
        "learner.epochs": Setting(1, f"{_SR1_VERL}, ppo_epochs: 1"),
        "learner.mini_batches": Setting(
            2, f"{_SR1}, ppo_mini_batch_size=256 of train_batch_size=512; {_TSPO}"
        ),
        "learner.shuffle": Setting(False, f"{_SR1_VERL}, actor.shuffle: False"),
        "learner.max_grad_norm": Setting(1.0, f"{_SR1_VERL}, grad_clip: 1.0"),
        "learner.kl_coef": Setting(1e-3, f"{_SR1}, kl_loss_coef=0.001; {_TSPO}"),
        "learner.kl_kind": Setting("k3", f"{_SR1}, kl_loss_type=low_var_kl"),
        "learner.reference_dtype": Setting(
            "bfloat16", "Search-R1's verl (verl/workers/fsdp_workers.py): the reference in bf16"
        ),
        "learner.entropy_coef": Setting(
            0.0, f"{_TSPO} (entropy coefficient 0; Search-R1's script keeps verl's 0.001)"
        ),
        "learner.loss.clip_low": Setting(0.2, f"{_SR1_VERL}, clip_ratio: 0.2"),
        "learner.loss.clip_high": Setting(0.2, f"{_SR1_VERL}, clip_ratio: 0.2"),
        "learner.loss.dual_clip_c": Setting(None, f"{_SR1_VERL}: no dual clip"),
        "learner.loss.agg_mode": Setting("token-mean", f"{_SR1_VERL}: a mean over all tokens"),
        "learner.temperature": Setting(1.0, "= generator.temperature"),
        "learner.gradient_checkpointing": Setting(
            True, f"{_SR1}, enable_gradient_checkpointing=true"
        ),
        "warm_start.enabled": Setting(False, f"{_TSPO}: RL from the instruct model"),
        "pipeline.steps": Setting(500, f"{_TSPO}: 500 steps"),
        "pipeline.groups_per_step": Setting(512, f"{_SR1}, train_batch_size=512; {_TSPO}"),
        "pipeline.max_staleness": Setting(0, f"{_SR1}: synchronous, generation then update"),
        "eval.enabled": Setting(True, f"{_SR1}, val_before_train=true"),
    },
    notes=(
        "a trajectory whose context reaches generator.max_context_tokens ends there "
        "(counted in gen/context_limit_hits); Search-R1 keeps its last 4,096 tokens and "
        "goes on",
    ),
)

SETUPS: dict[str, PublishedSetup] = {SEARCH_R1.name: SEARCH_R1}
"""The published setups a config's ``reproduces`` may name."""


def get_path(config: Any, dotted: str) -> Any:
    """``config.a.b.c`` for ``"a.b.c"``."""
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


def same_value(got: Any, wanted: Any) -> bool:
    """Equal, floats to 1e-9 relative (``1e-3`` written ``0.001``)."""
    if isinstance(wanted, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        return math.isclose(float(got), wanted, rel_tol=1e-9, abs_tol=0.0)
    return type(got) is type(wanted) and got == wanted


def setup_departures(cfg: Any) -> list[str]:
    """Where a run of ``cfg`` departs from the setup its ``reproduces`` names: a line per
    setting whose value differs, then the setup's notes. Empty without ``reproduces``."""
    name = getattr(cfg, "reproduces", None)
    if name is None:
        return []
    setup = SETUPS[name]
    out = []
    for key, setting in setup.settings.items():
        got = get_path(cfg, key)
        if not same_value(got, setting.value):
            out.append(f"{key} = {got!r} ({name}: {setting.value!r}, {setting.source})")
    return out + list(setup.notes)
