"""Learner: one policy update per trajectory batch, estimator-blind.

The learner reads only the columns every estimator produces (``turn_advantages``, and
``turn_clip_scale`` when a batch carries one) plus the token columns the generator wrote
(``input_ids``, ``loss_mask``, ``token_turn``, ``behavior_logprobs``). It never looks at
which estimator ran. One call of :meth:`Learner.train` is one published policy update:
``epochs`` passes over the batch, each split into ``mini_batches`` optimizer steps, each
optimizer step accumulated over micro-batches of at most ``micro_batch_tokens`` padded
tokens. The policy version then moves forward by one.

Loss of an optimizer step (verl's actor loss; :mod:`ray_credit.losses` for the terms)::

    L = agg(w * pg) + kl_coef * agg(KL(pi || pi_ref)) - entropy_coef * agg(H(pi))

``agg`` is ``loss.agg_mode``, computed over the whole mini-batch (and under data
parallelism, over the mini-batch of every rank): each token gets a weight from the
mini-batch's global counts, so splitting into micro-batches or ranks changes nothing but
float rounding. ``seq-mean-token-sum-norm`` divides by ``loss.loss_scale_factor``, or
else by the longest row of the mini-batch.

Off-policy correction (``off_policy``; docs/architecture.md, the asynchronous loop):

* ``"none"``: the ratio is taken against the behavior logprobs the generator recorded
  (PPO's clipped ratio against the sampling policy).
* ``"tis"``: the ratio is taken against the learner's own logprobs at the start of the
  update (the proximal policy), and each token's loss is multiplied by the truncated
  importance weight ``min(pi_prox / pi_behavior, is_cap)``; truncated tokens are counted.
  With one optimizer step per update its own forward gives the proximal logprobs
  (detached); with more, one no-grad pass before the first.
* ``"decoupled"``: decoupled PPO (AReaL): the same proximal ratio, weight
  ``pi_prox / pi_behavior``; tokens whose weight exceeds ``is_cap`` are left out of the
  loss, and counted.

The model is kept in eval mode (no dropout), so its logprobs are the generator's
sampling logprobs for the same weights.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import pickle
import random
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np

from ray_credit.actors.lora import (
    LoraConfig,
    adapter_state_dict,
    apply_lora,
    base_view,
    merged_state_dict,
)
from ray_credit.batch import TrajectoryBatch
from ray_credit.config import check_fields
from ray_credit.losses import KLKind, PolicyLossConfig
from ray_credit.models import (
    AttnImplementation,
    Autocast,
    Dtype,
    cpu_has_native_bf16,
    load_model,
    native_bf16,
)
from ray_credit.process_memory import PeakMeter, memory_report
from ray_credit.storage import StoragePath

__all__ = ["Learner", "LearnerConfig"]

OffPolicy = Literal["none", "tis", "decoupled"]
OFF_POLICY = get_args(OffPolicy)
LRSchedule = Literal["constant", "linear", "cosine"]
LR_SCHEDULES = get_args(LRSchedule)
Strategy = Literal["ddp", "fsdp"]
"""How several learner workers split the work (``resources.learner_strategy``)."""
_STATE_FILE = "learner_state.pt"
_ADAPTER_FILE = "adapter.safetensors"  # LoRA: the trained adapters, for resume
_STATE_KEYS = frozenset(
    (
        "optimizer",
        "scheduler",
        "policy_version",
        "optimizer_steps",
        "counters",
        "config",
        "rng",
        "reference",
    )
)


@dataclass(frozen=True)
class LearnerConfig:
    """Optimization settings of the learner (defaults: verl's actor, AdamW)."""

    lr: float = 1e-6
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.01
    """AdamW weight decay (verl's actor default)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    warmup_steps: int = 0
    """Training steps (updates: one call of ``train``, each of ``epochs x mini_batches``
    optimizer steps at one learning rate, as verl schedules it) of linear warm-up from 0
    to ``lr``."""
    lr_schedule: LRSchedule = "constant"
    """After warm-up: ``"constant"``, or ``"linear"`` / ``"cosine"`` decay to
    ``min_lr_ratio * lr`` at ``total_steps`` (which these two need)."""
    total_steps: int | None = None
    """Training steps of the whole run (decaying schedules only)."""
    min_lr_ratio: float = 0.0
    """Floor of the decaying schedules, as a fraction of ``lr``."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this; None disables clipping (the norm is still
    reported). A non-finite norm skips the optimizer step, and the skip is counted."""
    epochs: int = 1
    """Passes over each batch (PPO epochs)."""
    mini_batches: int = 1
    """Optimizer steps per epoch: the batch's trajectories are split into this many parts."""
    micro_batch_tokens: int = 4096
    """Padded tokens (rows x longest row) per forward pass; a longer row gets its own pass."""
    shuffle: bool = True
    """Shuffle trajectories before splitting them into mini-batches (seeded)."""
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Clipped surrogate settings (clip range, aggregation, token/turn ratio)."""
    kl_coef: float = 0.0
    """Weight of the KL to the frozen initial policy; 0 turns the reference model off (it
    is then never loaded)."""
    reference_dtype: Dtype | None = None
    """The dtype the frozen reference of the KL term is held in (None: ``dtype``).
    ``"bfloat16"`` halves a float32 reference, as verl holds its reference model; its
    log-probs are then bf16 forward passes (under autocast they are anyway)."""
    kl_kind: KLKind = "k3"
    """KL estimator (:func:`ray_credit.losses.kl_penalty`): k1 (alias kl), abs, k2 (mse) or
    k3 (low_var_kl); a trailing + takes k2's gradient with the named one's value."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (the entropy is reported either way)."""
    off_policy: OffPolicy = "none"
    """Off-policy correction: ``"none"`` (the ratio against the behavior logprobs),
    ``"tis"`` (truncated importance weights) or ``"decoupled"`` (AReaL's decoupled PPO);
    details in the docstring of :mod:`ray_credit.actors.learner`."""
    is_cap: float = 2.0
    """Importance-weight cap of ``"tis"`` (truncation) and ``"decoupled"`` (exclusion)."""
    temperature: float = 1.0
    """The generator's sampling temperature: logits are divided by it before every
    log-prob, ratio, KL and entropy, so that on-policy ratios are 1 (the generator's
    behavior logprobs are of the tempered distribution). Greedy generation: 1."""
    seed: int = 0
    """Seed of the mini-batch shuffling."""
    dtype: Dtype = "float32"
    """The dtype the policy and the frozen reference are held in: ``"float32"`` (exact
    logprobs, the default on CPUs), ``"bfloat16"`` (GPUs), ``"float16"`` or ``"auto"`` (the
    checkpoint's own), as :func:`ray_credit.models.load_model` takes it."""

    share_prefix: bool = True
    """Run the prefix that all rows of a micro-batch share (a group's prompt: G copies of
    it in a GRPO batch) through the model once, and each row only from there, on the
    prefix's keys and values repeated: the same logits and gradients up to float
    rounding, ~30 % less work at G=8 with a prompt a third of each row. Micro-batches are
    then formed group by group. A learner without a DDP or FSDP wrapper only (they wrap
    one forward per backward: a learner group's single worker has none); with one, rows
    are run whole."""
    autocast: Autocast | None = None
    """Mixed precision: ``"bfloat16"`` (or ``"float16"``) runs the forward and backward
    matmuls in that dtype under ``torch.autocast`` while weights, gradients and optimizer
    state stay in ``dtype`` (float32 master weights). None: off. On CPUs with bf16
    instructions (avx512_bf16, AMX) it is ~2x faster; on CPUs without them torch
    emulates bf16 and an update takes ~13x as long (logged once). ``"auto"``: bfloat16
    where the device has it natively (those CPUs, CUDA GPUs with bf16), else off; the
    choice is logged once per process. Log-probs then differ from a float32 generator's
    by bf16 rounding, which shows in ``learner/ratio_*``."""
    gradient_checkpointing: bool = False
    """Recompute each transformer block's activations in the backward pass instead of
    keeping them: about a third more compute, for activation memory that no longer grows
    with the number of layers (long contexts, billions of parameters on one GPU). Not
    with share_prefix (the shared prefix's keys and values would be dropped)."""
    attn_implementation: AttnImplementation | None = None
    """The attention kernel: 'sdpa' (PyTorch's fused attention), 'eager', 'flash_attention_2'
    (needs flash-attn and a GPU), ...; None: transformers' default for the model."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters (peft) instead of full fine-tuning: the optimizer holds only the
    adapters; generators, the scorer and checkpoints get the merged weights."""

    def __post_init__(self) -> None:
        check_fields(self)  # types first: the checks below compare numbers
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(
                f"temperature must be a positive finite number (the generator's; greedy: 1), "
                f"got {self.temperature}"
            )
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive finite number, got {self.lr}")
        if self.lr_schedule != "constant" and (self.total_steps is None or self.total_steps < 1):
            raise ValueError(
                f"lr_schedule={self.lr_schedule!r} decays to total_steps; set total_steps >= 1"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}")
        for name in ("epochs", "mini_batches", "micro_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.max_grad_norm is not None and not 0 < self.max_grad_norm < math.inf:
            raise ValueError(
                f"max_grad_norm must be a positive finite number, or None for no clipping, "
                f"got {self.max_grad_norm}"
            )
        for name in ("kl_coef", "entropy_coef", "weight_decay"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {getattr(self, name)}")
        if not all(0 <= beta < 1 for beta in self.betas):
            raise ValueError(f"betas must each lie in [0, 1) (AdamW's), got {self.betas}")
        if self.gradient_checkpointing and self.share_prefix:
            raise ValueError(
                "gradient_checkpointing recomputes each block without the shared prefix's "
                "keys and values that share_prefix passes it; set share_prefix false with it"
            )
        if not 1.0 < self.is_cap < math.inf:
            raise ValueError(f"is_cap must be a finite number > 1 (e.g. 2.0), got {self.is_cap}")

    def lr_at(self, step: int) -> float:
        """The learning rate of training step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / (self.warmup_steps + 1)
        if self.lr_schedule == "constant":
            return self.lr
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        if self.lr_schedule == "linear":
            decay = 1.0 - progress
        else:
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * decay)


class Learner:
    """A causal LM policy and its optimizer; :meth:`train` applies one update per batch.

    Args:
        model: ``"smollm2-135m"``, ``"tiny-random"``, an HF id or folder (a learner
            checkpoint's ``model/`` folder too), or a loaded ``(model, tokenizer)`` pair
            (then trained in place).
        config: :class:`LearnerConfig` (``config.dtype``: how the policy and the reference
            are held; a loaded pair is kept as it is).
        device: where to hold the policy (and the reference, if any).
        world: data-parallel hooks (:class:`TorchDistributed`, :class:`TorchFSDP`), set by
            :class:`~ray_credit.actors.learner_group.LearnerGroup`'s workers once they joined
            their process group; ``None`` is one process.
    """

    def __init__(
        self,
        model: str | tuple[Any, Any] = "smollm2-135m",
        config: LearnerConfig | None = None,
        *,
        device: str = "cpu",
        world: DataParallel | None = None,
    ) -> None:
        import torch

        self.config = config or LearnerConfig()
        pair = (
            model
            if isinstance(model, tuple)
            else load_model(
                model,
                dtype=self.config.dtype,
                device=device,
                attn_implementation=self.config.attn_implementation,
            )
        )
        self.model, self.tokenizer = pair
        self.model.eval()  # no dropout: the learner's logprobs are the sampler's
        self.world = world or DataParallel()
        self.reference = None
        lora = self.config.lora
        if self.config.kl_coef > 0 and not lora.enabled:  # copied before wrapping: whole
            reference = copy.deepcopy(self.model).eval().requires_grad_(False)
            wanted = self.config.reference_dtype
            if wanted is not None and wanted != "auto":
                reference = reference.to(getattr(torch, wanted))
            self.reference = self.world.wrap_frozen(reference)
        if lora.enabled:  # the reference is then the base: the model, adapters off
            self.model = apply_lora(self.model, lora)
        if self.config.gradient_checkpointing:
            _checkpoint_activations(self.model)
        self.train_model = self.world.wrap(self.model)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=self.config.lr, betas=self.config.betas,
            weight_decay=self.config.weight_decay,
        )  # fmt: skip
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: self.config.lr_at(step) / self.config.lr
        )
        self.policy_version = 0
        self.optimizer_steps = 0
        self.counters = {
            "learner/nonfinite_grad_steps": 0,
            "learner/batches": 0,
            "learner/zero_gradient_batches": 0,
            "learner/zero_advantage_trajectories": 0,
        }
        self._rng = np.random.default_rng(self.config.seed)
        self._weight_group = None  # set by open_weight_group (broadcast weight sync)
        self._memory = PeakMeter()  # the process's peak between updates

    # ---------------------------------------------------------------------- weights
    @property
    def device(self):
        return next(self.model.parameters()).device

    def get_weights(self, dtype: str | None = None) -> dict[str, Any]:
        """The policy's full state dict as CPU tensors (what generators and scorers load;
        with LoRA, the merged weights under the base model's names); its floating-point
        tensors cast to ``dtype`` when given (``"bfloat16"`` for a bf16 generator, which
        would round them so itself).

        Under FSDP every rank must call it (the shards are gathered); rank 0 gets the
        weights, the others an empty dict."""
        state = self._published(self.world.full_state_dict(self.model))
        if dtype is None:
            return state
        import torch

        cast = getattr(torch, dtype, None)
        if not isinstance(cast, torch.dtype) or not cast.is_floating_point:
            raise ValueError(f"weights can be published in a floating-point dtype, not {dtype!r}")
        return {k: v.to(cast) if v.is_floating_point() else v for k, v in state.items()}

    def _published(self, state: dict[str, Any]) -> dict[str, Any]:
        """What others load of a full state dict: the merged weights under LoRA."""
        if not state or not self.config.lora.enabled:
            return state
        return merged_state_dict(state, self.config.lora)

    # --------------------------------------------------- collective weight sync
    def open_weight_group(
        self, world_size: int, backend: str, timeout_s: float = 600.0
    ) -> str | None:
        """Rank 0: open a broadcast group for itself and ``world_size - 1`` generators
        (:mod:`ray_credit.actors.collective`); returns its ``host:port`` (None elsewhere)."""
        from ray_credit.actors.collective import WeightGroup

        if self.world.rank != 0:
            return None
        import ray

        self._weight_group = WeightGroup(backend, world_size, timeout_s)
        return self._weight_group.open(ray.util.get_node_ip_address())

    def weight_manifest(self) -> list:
        """Names, shapes and dtypes of the published weights, in broadcast order."""
        from ray_credit.actors.collective import manifest_of

        state = self.model.state_dict()  # global shapes, also under FSDP
        return manifest_of(base_view(state) if self.config.lora.enabled else state)

    def join_weight_group(self, address: str, manifest: list) -> None:
        """Rank 0 joins as the sender (blocks until every generator has joined)."""
        if self.world.rank == 0:
            self._opened_weight_group().join(address, 0, manifest)

    def broadcast_weights(self) -> int:
        """Send the current weights to the group (every rank calls it: FSDP gathers them
        first); returns the policy version sent."""
        weights = self.get_weights()
        if self.world.rank == 0:
            self._opened_weight_group().broadcast(weights, device=str(self.device))
        return self.policy_version

    def _opened_weight_group(self):
        if self._weight_group is None:
            raise RuntimeError(
                "this learner has no weight group: call open_weight_group, then "
                "join_weight_group, before broadcasting"
            )
        return self._weight_group

    def get_policy_version(self) -> int:
        return self.policy_version

    # ------------------------------------------------------------------------ train
    def train(self, batch: TrajectoryBatch) -> dict[str, float]:
        """One policy update on ``batch`` (needs ``turn_advantages``); returns its metrics.

        Under data parallelism every rank passes the whole batch and trains on its share
        of each mini-batch (every ``size``-th trajectory of it).
        """
        import torch

        start = time.perf_counter()
        batch.require(("turn_advantages",), by="Learner.train")
        if len(batch) < self.config.mini_batches * self.world.size:
            raise ValueError(
                f"a batch of {len(batch)} trajectories cannot give each of {self.world.size} "
                f"rank(s) a trajectory in each of mini_batches={self.config.mini_batches}; "
                "use larger batches, or fewer mini-batches or workers"
            )
        tensors = batch.to_torch(pad_token_id=int(self.tokenizer.pad_token_id))
        # Position t predicts token t+1: every per-token tensor is shifted to the targets.
        data = {
            "input_ids": tensors["input_ids"],
            "attention_mask": tensors["attention_mask"],
            "mask": tensors["loss_mask"][:, 1:],
            "behavior": tensors["behavior_logprobs"][:, 1:],
            "advantages": tensors["advantages"][:, 1:],
            "token_turn": tensors["token_turn"][:, 1:],
        }
        if "clip_scale" in tensors:
            data["clip_scale"] = tensors["clip_scale"][:, 1:]
        lengths = tensors["attention_mask"].sum(-1)
        n = len(batch)
        if self._sharing:  # micro-batches then go prompt by prompt
            data["prompt_key"] = _prompt_keys(data["input_ids"], data["mask"])
        # The same schedule on every rank (same seed); each rank takes its share of every
        # mini-batch, so the update does not depend on the number of ranks.
        schedule = []
        for _ in range(self.config.epochs):
            order = self._rng.permutation(n) if self.config.shuffle else np.arange(n)
            schedule += [
                rows[self.world.rank :: self.world.size]
                for rows in np.array_split(order, self.config.mini_batches)
            ]
        # A trajectory whose advantages are all 0 adds exactly 0 to the gradient when there
        # is no KL or entropy term: it keeps its place in the loss's normalizer (the token
        # weights) but is left out of the passes. The update is the same, minus the work.
        live = self._rows_with_gradient(data)
        self.counters["learner/zero_advantage_trajectories"] += int(n - live.sum())
        needed = np.intersect1d(np.concatenate(schedule), np.flatnonzero(live))
        if not live.any():
            # the loss's gradient is exactly zero: the passes are skipped and the optimizer
            # steps on zero gradients (as it would after them: AdamW's momentum and weight
            # decay still move weights)
            self.counters["learner/zero_gradient_batches"] += 1
            return self._finish(self._zero_steps(len(schedule)), tensors, n, start)
        # The proximal log-probs are the policy's at the start of the update. With one
        # optimizer step (one epoch of one mini-batch: on every rank alike) that step's own
        # forward runs on those weights: it fills them in (detached) as it goes, and no
        # pass of their own is run. With more, the later steps need them from before.
        own_pass = len(schedule) > 1
        if self.config.off_policy != "none":
            data["proximal"] = (
                self._logprobs_no_grad(self.model, data, lengths, needed)
                if own_pass
                else torch.zeros_like(data["behavior"])
            )
        if self.reference is not None:
            data["reference"] = self._logprobs_no_grad(self.reference, data, lengths, needed)
        elif self._kl_to_base:  # LoRA: the initial policy is the model with adapters off
            with self.model.disable_adapter():
                data["reference"] = self._logprobs_no_grad(self.model, data, lengths, needed)

        totals: dict[str, float] = {}
        ratio_max = 0.0
        for rows in schedule:
            step_metrics = self._optimizer_step(
                data, lengths, torch.as_tensor(rows), live[rows],
                fill_proximal=self.config.off_policy != "none" and not own_pass,
            )  # fmt: skip
            ratio_max = max(ratio_max, step_metrics.pop("ratio_max"))
            for key, value in step_metrics.items():
                totals[key] = totals.get(key, 0.0) + value
        steps = self.config.epochs * self.config.mini_batches
        means = {k: v / steps for k, v in totals.items()}  # per optimizer step
        means["ratio_max"] = ratio_max  # of the whole update
        return self._finish(means, tensors, n, start)

    def _rows_with_gradient(self, data: dict) -> np.ndarray:
        """Which trajectories can add to the gradient: all of them under a KL or entropy
        term, else those with a non-zero advantage on a trained token (with ``A = 0`` every
        form of the clipped surrogate, at token or turn level, is 0 with gradient 0)."""
        n = len(data["advantages"])
        if self.config.kl_coef != 0 or self.config.entropy_coef != 0:
            return np.ones(n, dtype=bool)
        return (data["advantages"] * data["mask"]).ne(0).any(-1).numpy()

    def _zero_steps(self, count: int) -> dict[str, float]:
        """``count`` optimizer steps on zero gradients; the step's loss metrics are 0."""
        import torch

        for _ in range(count):
            self.optimizer.zero_grad(set_to_none=True)
            for p in self.model.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
            self._clip_and_step()
        return {"loss": 0.0, "pg_loss": 0.0, "grad_norm": 0.0}

    def _finish(self, means: dict, tensors: dict, n: int, start: float) -> dict:
        """The update's metrics (``means``: per optimizer step), after the version moves.
        ``learner/tokens_per_s``: the batch's trained tokens times the epochs, over the
        update's seconds (each epoch goes over every token once, whatever the number of
        mini-batches it is cut into)."""
        metrics = {f"learner/{k}": v for k, v in means.items()}
        metrics.update(self._memory_metrics())
        lr = float(self.scheduler.get_last_lr()[0])  # this update's, for all its steps
        self.scheduler.step()  # the schedule counts training steps, as verl's does
        self.policy_version += 1
        self.counters["learner/batches"] += 1
        seconds = time.perf_counter() - start
        tokens = float(tensors["loss_mask"].sum())  # every rank holds the whole batch
        metrics.update(
            {
                "learner/policy_version": float(self.policy_version),
                "learner/optimizer_steps": float(self.optimizer_steps),
                "learner/lr": lr,
                "learner/trajectories": float(n),
                "learner/tokens": tokens,
                "learner/seconds": seconds,
                "learner/tokens_per_s": (
                    tokens * self.config.epochs / seconds if seconds > 0 else 0.0
                ),
                **{k: float(v) for k, v in self.counters.items()},
            }
        )
        return metrics

    def _memory_metrics(self) -> dict[str, float]:
        """This process's peak resident memory since the last update ended (the update's
        passes, and the weights published or saved in between) and what it holds once the
        allocator has given back the pages the update freed, in GiB: ``memory/learner_*``,
        the largest over the ranks of a data-parallel learner."""
        report = memory_report(self._memory) or {"rss_gb": -1.0, "peak_gb": -1.0}
        rss = self.world.all_reduce_max(report["rss_gb"])  # every rank takes part
        peak = self.world.all_reduce_max(report["peak_gb"])
        if rss < 0:  # no rank could read its memory (no /proc)
            return {}
        return {"memory/learner_rss_gb": rss, "memory/learner_peak_gb": peak}

    def _optimizer_step(
        self, data: dict, lengths, rows, live: np.ndarray, *, fill_proximal: bool = False
    ) -> dict[str, float]:
        """One optimizer step on the mini-batch ``rows``; only the ``live`` ones (see
        :meth:`_rows_with_gradient`) go through the model, and the token metrics
        (entropy, clip fraction, ratios) are theirs. A rank with no live row runs one
        zeroed pass, for the collectives and for AdamW to see a zero gradient.
        ``fill_proximal``: the weights are the update's first, so each pass's log-probs,
        detached, are its rows' proximal ones (``data["proximal"]``, filled in here)."""
        import torch

        from ray_credit.losses import entropy_from_logits, kl_penalty, policy_loss_per_token

        config = self.config
        mask = data["mask"][rows]
        turn_level = config.loss.ratio_level == "turn"
        weights = self._token_weights(mask)  # (R, L-1): agg_mode over the global mini-batch
        positions = np.flatnonzero(live)
        idle = len(positions) == 0
        if idle:
            positions = np.zeros(1, dtype=np.int64)
        self.optimizer.zero_grad(set_to_none=True)
        sums = {k: 0.0 for k in ("loss", "pg_loss", "kl", "entropy", "clipfrac", "approx_kl")}
        sums.update(ratio_mean=0.0, ratio_max=0.0, is_weight_mean=0.0, is_limited=0.0)
        token_count = 0.0
        micro = [
            (positions[part], dummy or idle)
            for part, dummy in self._passes(lengths, rows[positions].numpy(), data)
        ]
        count = len(micro)
        for i, (part, dummy) in enumerate(micro):
            index = rows[part]
            width = int(lengths[index].max())
            sl = trained_span(data["mask"][index], width)
            m = data["mask"][index, sl].to(self.device)
            w = weights[part, sl].to(self.device)
            with self.world.no_sync(self.train_model) if i < count - 1 else _null():
                logits, cols = self._logits(self.train_model, data, index, sl)
                targets = data["input_ids"][index, sl.start + 1 : width].to(self.device)
                span = sl.stop - sl.start
                logp = spread(token_logprobs(logits, targets[:, cols]), cols, span)
                if fill_proximal and not dummy:
                    data["proximal"][index, sl] = (
                        logp.detach().float().cpu() * data["mask"][index, sl]
                    )
                old = data["proximal" if config.off_policy != "none" else "behavior"]
                pg = policy_loss_per_token(
                    logp, old[index, sl].to(self.device), data["advantages"][index, sl].to(self.device),
                    m, config.loss,
                    token_turn=data["token_turn"][index, sl].to(self.device) if turn_level else None,
                    clip_scale=data["clip_scale"][index, sl].to(self.device) if "clip_scale" in data else None,
                )  # fmt: skip
                per_token = pg.loss
                if config.off_policy != "none":
                    is_weight, limited = self._importance_weight(data, index, sl, m)
                    per_token = per_token * is_weight
                    if not dummy:
                        sums["is_weight_mean"] += float((is_weight * m).sum())
                        sums["is_limited"] += float((limited * m).sum())
                entropy = spread(
                    entropy_from_logits(
                        logits.float() if config.entropy_coef else logits.detach().float()
                    ),
                    cols, span,
                )  # fmt: skip
                loss = (per_token * w).sum()
                kl = None
                if "reference" in data:
                    kl = kl_penalty(
                        logp, data["reference"][index, sl].to(self.device), config.kl_kind
                    )
                    loss = loss + config.kl_coef * (kl * w).sum()
                if config.entropy_coef:
                    loss = loss - config.entropy_coef * (entropy * w).sum()
                if dummy:
                    loss = loss * 0.0
                (loss * self.world.size).backward()  # DDP / FSDP average gradients over ranks
            if dummy:
                continue
            with torch.no_grad():
                sums["loss"] += float(loss)
                sums["pg_loss"] += float((per_token * w).sum())
                sums["kl"] += float((kl * m).sum()) if kl is not None else 0.0
                sums["entropy"] += float((entropy * m).sum())
                sums["clipfrac"] += float((pg.clipped.float() * m).sum())
                sums["approx_kl"] += float(((old[index, sl].to(self.device) - logp) * m).sum())
                sums["ratio_mean"] += float((pg.ratio * m).sum())
                sums["ratio_max"] = max(
                    sums["ratio_max"], float((pg.ratio * m).max()) if m.any() else 0.0
                )
                token_count += float(m.sum())
        # the last micro-batch's logits and per-token tensors (on a 150k vocabulary, GBs)
        # are not held through AdamW's step, whose own temporaries peak there
        logits = logp = pg = per_token = entropy = loss = kl = None
        grad_norm = self._clip_and_step()
        local = {k: v for k, v in sums.items() if k not in ("loss", "pg_loss", "ratio_max")}
        summed = self.world.all_reduce_sum(
            {**local, "tokens": token_count, "loss": sums["loss"], "pg_loss": sums["pg_loss"]}
        )
        tokens = max(summed.pop("tokens"), 1.0)
        out = {k: summed[k] for k in ("loss", "pg_loss")}
        out.update(
            {k: v / tokens for k, v in summed.items() if k not in ("loss", "pg_loss", "is_limited")}
        )
        out["ratio_max"] = self.world.all_reduce_max(sums["ratio_max"])
        out["grad_norm"] = grad_norm
        if config.off_policy != "none":
            out["is_limited_frac"] = summed["is_limited"] / tokens
        else:
            out.pop("is_weight_mean")
        return out

    def _clip_and_step(self) -> float:
        import torch

        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm is not None else math.inf
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP
        if not math.isfinite(norm):
            self.counters["learner/nonfinite_grad_steps"] += 1
            self.optimizer.zero_grad(set_to_none=True)
            return norm
        self.optimizer.step()
        # the gradients are not read again before the next step's first backward: freed
        # now, not held between updates (the policy's size again, in float32)
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        return norm

    def _token_weights(self, mask):
        """Per-token weights whose weighted sum over the global mini-batch is ``agg_mode``."""
        import torch

        mode = self.config.loss.agg_mode
        counts = mask.sum(-1)
        if mode == "token-mean":
            total = self.world.all_reduce_sum({"n": float(counts.sum())})["n"]
            return mask / max(total, 1.0)
        if mode == "seq-mean-token-sum-norm":
            scale = self.config.loss.loss_scale_factor
            if scale is None:
                scale = self.world.all_reduce_max(float(mask.shape[-1]))
            return mask / scale
        rows = self.world.all_reduce_sum({"r": float((counts > 0).sum())})["r"]
        if mode == "seq-mean-token-sum":
            return mask / max(rows, 1.0)
        per_row = 1.0 / (counts + 1e-8)
        return mask * per_row[:, None] / max(rows, 1.0) * (counts > 0)[:, None].to(torch.float32)

    def _importance_weight(self, data: dict, index, sl, mask):
        import torch

        log_w = (data["proximal"][index, sl] - data["behavior"][index, sl]).to(self.device)
        weight = torch.exp(log_w.clamp(max=20.0))
        limited = weight > self.config.is_cap
        if self.config.off_policy == "tis":
            weight = weight.clamp(max=self.config.is_cap)
        else:  # decoupled: tokens beyond the cap leave the loss
            weight = torch.where(limited, torch.zeros_like(weight), weight)
        return weight, limited.float()

    def _passes(self, lengths, rows: np.ndarray, data: dict) -> list[tuple[np.ndarray, bool]]:
        """The micro-batches of ``rows`` as ``(positions in rows, dummy)``, prompt by prompt
        when ``data`` has prompt keys. Under FSDP every rank runs as many forward (and
        backward) passes as the busiest one, since each pass gathers parameters from all
        ranks: the extra ones repeat a row and are marked dummy, to be run for the
        collectives and their results left out."""
        keys = data.get("prompt_key")
        micro = list(self._micro_batches(lengths[rows], None if keys is None else keys[rows]))
        extra = self.world.equal_count(len(micro)) - len(micro)
        return [(part, False) for part in micro] + [(micro[0][:1], True)] * extra

    def _micro_batches(self, lengths, keys=None):
        return micro_batches(lengths, self.config.micro_batch_tokens, keys=keys)

    @property
    def _kl_to_base(self) -> bool:
        """A KL to the initial policy, which under LoRA is the model with adapters off."""
        return self.config.kl_coef > 0 and self.config.lora.enabled

    @property
    def _sharing(self) -> bool:
        return self.config.share_prefix and not isinstance(self.world, TorchDistributed)

    def _logits(self, model, data: dict, index, span: slice):
        """Tempered logits of the target positions in ``span`` (position t predicts token
        t+1) that a row of the micro-batch trains on, and those positions, relative to
        ``span.start`` (a 1-D tensor; :func:`spread` puts per-position values back in
        place). Only they go through the vocabulary projection: a prompt and the
        observations between turns need none, and on a 49k vocabulary that projection and
        its float32 logits are a fifth or more of a small model's forward and backward."""
        width = span.stop + 1
        ids = data["input_ids"][index, :width].to(self.device)
        attention = data["attention_mask"][index, :width].to(self.device)
        cols = trained_columns(data["mask"][index, span]).to(self.device)
        shared = shared_prefix_length(ids, attention, span.start) if self._sharing else 0
        with autocast(self.device, self.config.autocast):
            if shared >= MIN_SHARED_PREFIX and len(ids) > 1:
                # the prompt's keys and values only: one position's logits (0 means all)
                head = model(
                    input_ids=ids[:1, :shared], use_cache=True, logits_to_keep=1
                ).past_key_values
                head.batch_repeat_interleave(len(ids))  # keeps the graph: grads add up
                out = model(
                    input_ids=ids[:, shared:], attention_mask=attention,
                    past_key_values=head, use_cache=False,
                    logits_to_keep=span.start - shared + cols,
                )  # fmt: skip
            else:
                out = model(
                    input_ids=ids, attention_mask=attention, logits_to_keep=span.start + cols
                )
        logits = out.logits.float()
        t = self.config.temperature
        return (logits if t == 1.0 else logits / t), cols

    def _logprobs_no_grad(self, model, data: dict, lengths, rows: np.ndarray):
        """Per-token logprobs of ``model`` on ``rows`` (targets-aligned, CPU; 0 elsewhere)."""
        import torch

        out = torch.zeros_like(data["behavior"])
        with torch.no_grad():
            for part, dummy in self._passes(lengths, rows, data):
                index = torch.as_tensor(rows[part])
                width = int(lengths[index].max())
                sl = trained_span(data["mask"][index], width)
                logits, cols = self._logits(model, data, index, sl)
                if dummy:
                    continue
                ids = data["input_ids"][index, sl.start + 1 : width].to(self.device)
                logp = token_logprobs(logits, ids[:, cols])
                out[index, sl] = spread(logp, cols, sl.stop - sl.start).float().cpu()
        self.world.release(model)
        return out * data["mask"]

    # ------------------------------------------------------------------- checkpoint
    def save(self, folder: str | Path | StoragePath) -> StoragePath:
        """Model (+ tokenizer) in HF format under ``folder/model``; optimizer, scheduler,
        RNG states and counters in ``folder/learner_state.pt``. ``folder``: a path or a URI
        (:class:`~ray_credit.storage.StoragePath`; to an object store, rank 0 writes in a
        local temporary folder and uploads it).

        The state file holds only tensors, numbers, strings, None and dicts, lists and
        tuples of them (the RNG states too: numpy's is a dict of ints, Python's a tuple),
        so that :meth:`load_state` reads it with ``torch.load(weights_only=True)``, which
        never runs code from the file."""
        import torch

        target = StoragePath(folder)
        weights = self.world.full_state_dict(self.model)  # collective under FSDP
        optimizer = self.world.optimizer_state(self.model, self.optimizer)
        reference = (
            self.world.full_state_dict(self.reference) if self.reference is not None else None
        )
        if self.world.rank != 0:
            return target
        lora = self.config.lora.enabled
        base = self.model.get_base_model() if lora else self.model
        state = {
            "optimizer": optimizer,
            "scheduler": self.scheduler.state_dict(),
            "policy_version": self.policy_version,
            "optimizer_steps": self.optimizer_steps,
            "counters": dict(self.counters),
            "config": asdict(self.config),
            "rng": {
                "numpy": self._rng.bit_generator.state,
                "torch": torch.get_rng_state(),
                "python": random.getstate(),
            },
            "reference": reference,
        }
        with target.staged_directory() as local:
            base.save_pretrained(  # under LoRA the merged weights: a plain HF / vLLM folder
                local / "model", state_dict=self._published(weights), safe_serialization=True
            )
            self.tokenizer.save_pretrained(local / "model")
            if lora:  # what resume loads over the base model (never the merged weights)
                from safetensors.torch import save_file

                adapters = adapter_state_dict(weights)
                save_file({k: v.contiguous() for k, v in adapters.items()}, local / _ADAPTER_FILE)
            torch.save(state, local / _STATE_FILE)
        return target

    def load_state(self, folder: str | Path | StoragePath) -> None:
        """Restore what :meth:`save` wrote (the model itself is loaded from ``folder/model``
        by the constructor: ``Learner(f"{folder}/model", config)``). ``folder``: a path or a
        URI (downloaded first).

        Raises:
            FileNotFoundError: ``folder`` has no state file.
            ValueError: the file is damaged, is not a learner checkpoint, holds objects
                other than tensors and plain containers (refused unread: unpickling them
                could run code), or was written with a different config.
        """
        source = StoragePath(folder)
        if not (source / _STATE_FILE).is_file():
            raise FileNotFoundError(
                f"{source / _STATE_FILE} does not exist: not a learner checkpoint folder"
            )
        with source.as_directory() as local:
            self._load_state(local)

    def _load_state(self, folder: Path) -> None:
        import torch

        path = folder / _STATE_FILE
        state = _read_state(path)
        saved = state["config"]
        mismatched = {
            k: (saved.get(k), v)
            for k, v in asdict(self.config).items()
            if k in ("kl_coef", "off_policy", "mini_batches", "epochs", "lora")
            and saved.get(k) != v
        }
        if mismatched:
            raise ValueError(
                f"{path} was written with a different learner config {mismatched} "
                "(saved, current); resume with the same settings"
            )
        if self.config.lora.enabled:
            self._load_adapters(folder / _ADAPTER_FILE)
        self.world.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.policy_version = int(state["policy_version"])
        self.optimizer_steps = int(state["optimizer_steps"])
        self.counters.update(state["counters"])
        self._rng.bit_generator.state = state["rng"]["numpy"]
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        if self.reference is not None and state["reference"] is not None:
            self.world.load_state_dict(self.reference, state["reference"])

    def _load_adapters(self, path: Path) -> None:
        """The LoRA adapters :meth:`save` wrote, over this learner's base model."""
        from safetensors.torch import load_file  # tensors only: nothing to unpickle

        if not path.is_file():
            raise FileNotFoundError(
                f"{path} does not exist: the checkpoint was saved without LoRA adapters; "
                "resume with the learner.lora settings it was written with"
            )
        adapters = load_file(str(path))
        expected = set(adapter_state_dict(self.model.state_dict()))
        if set(adapters) != expected:
            raise ValueError(
                f"{path} holds adapters for other layers than this learner's "
                f"({len(set(adapters) - expected)} unknown, {len(expected - set(adapters))} "
                "missing); resume with the learner.lora settings it was written with"
            )
        self.world.load_state_dict(self.model, adapters, strict=False)


def _checkpoint_activations(model: Any) -> None:
    """Recompute each block's activations in the backward pass (transformers' gradient
    checkpointing). It acts in training mode only, so the model is put in it with every
    dropout at 0: the learner's log-probs stay the sampler's."""
    import torch

    if not getattr(model, "supports_gradient_checkpointing", True):
        raise ValueError(
            f"{type(model).__name__} does not support gradient checkpointing; set "
            "learner.gradient_checkpointing false"
        )
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()


def _read_state(path: Path) -> dict[str, Any]:
    """The dict :meth:`Learner.save` wrote to ``path``, read with ``weights_only=True``."""
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
        raise ValueError(
            f"{path} is not a learner checkpoint (or was written by something else, or is "
            f"damaged): torch.load(weights_only=True) refused it ({type(err).__name__}). A "
            "learner checkpoint holds only tensors, numbers, strings and containers; "
            "nothing else is unpickled, since that could run code"
        ) from err
    missing = _STATE_KEYS - state.keys() if isinstance(state, dict) else _STATE_KEYS
    if missing:
        raise ValueError(
            f"{path} is not a learner checkpoint (or was written by something else): "
            f"it lacks {sorted(missing)}"
        )
    return state


def trained_span(mask, width: int) -> slice:
    """Target positions ``[first trained token of any row, width - 1)`` of a micro-batch
    (``mask``: target-aligned loss mask, rows x positions); one position when no row
    has a trained token (the pass still runs, e.g. for FSDP's collectives)."""
    trained = mask[:, : width - 1].any(0).nonzero()
    start = int(trained[0]) if len(trained) else width - 2
    return slice(max(start, 0), width - 1)


def trained_columns(mask):
    """The columns of ``mask`` (a micro-batch's loss mask over its trained span, rows x
    positions) that some row trains on, as a 1-D index tensor: the positions whose
    logits are needed. The last one when no row trains (a pass run for FSDP's
    collectives still needs a position)."""
    import torch

    cols = mask.any(0).nonzero()[:, 0]
    return cols if len(cols) else torch.tensor([mask.shape[1] - 1])


MIN_SHARED_PREFIX = 16  # shorter common prefixes are run whole: not worth a second call


def micro_batches(lengths, budget: int, *, keys=None):
    """Groups of row positions of at most ``budget`` padded tokens each; a row longer
    than ``budget`` gets a pass of its own. Rows go longest first; with ``keys`` (one
    per row, e.g. :func:`_prompt_keys`), rows of the same key go together, longest first
    within each, so that a micro-batch shares its prompt."""
    lengths = np.asarray(lengths)
    if keys is None:
        order = np.argsort(-lengths, kind="stable")
    else:
        order = np.lexsort((-lengths, np.asarray(keys)))
    part: list[int] = []
    longest = 0
    for pos in order:
        longest = max(longest, int(lengths[pos]))
        if part and (len(part) + 1) * longest > budget:
            yield np.array(part)
            part, longest = [], int(lengths[pos])
        part.append(int(pos))
    if part:
        yield np.array(part)


def shared_prefix_length(ids, attention, limit: int) -> int:
    """Length of the prefix that every row of ``ids`` shares, unpadded, cut to ``limit``
    (the first position whose logits are needed) and to one token short of the rows."""
    same = (ids == ids[:1]).all(0) & attention.bool().all(0)
    same = same[: min(limit, ids.shape[1] - 1)]
    return int(same.long().cumprod(0).sum())


def _prompt_keys(input_ids, mask) -> np.ndarray:
    """One integer per row naming its tokens before its first trained token (a group's
    rows share one): rows of a key share their prompt."""
    first = np.asarray(mask.float().argmax(-1))
    ids = np.asarray(input_ids)
    seen: dict[bytes, int] = {}
    return np.array(
        [seen.setdefault(ids[r, : first[r] + 1].tobytes(), len(seen)) for r in range(len(ids))],
        dtype=np.int64,
    )


def check_autocast(dtype: str | None) -> None:
    """Raise ValueError unless ``dtype`` is an autocast setting :func:`autocast` takes."""
    if dtype is not None and dtype not in get_args(Autocast):
        *most, last = map(repr, get_args(Autocast))
        raise ValueError(f"autocast must be None, {', '.join(most)} or {last}, got {dtype!r}")


def autocast(device: Any, dtype: str | None):
    """``torch.autocast`` on ``device``'s type in ``dtype`` (None: a no-op context;
    ``"auto"``: :func:`resolve_autocast`'s choice). On a CPU without bfloat16
    instructions, ``"bfloat16"`` logs once per process that torch emulates it
    (:func:`cpu_has_native_bf16`)."""
    import torch

    kind = torch.device(device).type
    dtype = resolve_autocast(kind, dtype)
    if dtype is None:
        return _null()
    if kind == "cpu" and dtype == "bfloat16":
        _warn_emulated_bf16()
    return torch.autocast(kind, dtype=getattr(torch, dtype))


def resolve_autocast(device: Any, dtype: str | None) -> str | None:
    """The autocast dtype ``dtype`` means on ``device`` (a device or its type): itself,
    except ``"auto"``: ``"bfloat16"`` on a CUDA GPU that supports it and on a CPU with
    bfloat16 instructions (:func:`cpu_has_native_bf16`), where it is faster than float32,
    else None (float32: on other CPUs torch emulates bf16, 13x as slow). The choice is
    logged once per process and device type."""
    if dtype != "auto":
        return dtype
    import torch

    return _auto_autocast(torch.device(device).type)


@functools.cache
def _auto_autocast(kind: str) -> str | None:
    native, where = native_bf16(kind)
    chosen = "bfloat16" if native else None
    logging.getLogger(__name__).info(
        f"autocast 'auto': {'bfloat16' if native else 'off (float32)'} on {kind}: {where}"
    )
    return chosen


@functools.cache
def _warn_emulated_bf16() -> None:
    if cpu_has_native_bf16() is False:
        logging.getLogger(__name__).warning(
            "autocast 'bfloat16' on a CPU without bfloat16 instructions (no AVX512-BF16, "
            "no AMX): torch emulates them, and an update of SmolLM2-135M took 13x as long "
            "as in float32 on such a CPU (docs/benchmarks.md). Set autocast to null "
            "(learner.autocast, warm_start.autocast) unless this is a test of it"
        )


def spread(values, cols, width: int):
    """``values`` (rows x len(cols)) put at columns ``cols`` of a rows x ``width`` tensor
    of zeros (differentiable in ``values``)."""
    import torch

    out = torch.zeros(values.shape[0], width, dtype=values.dtype, device=values.device)
    return out.index_copy(1, cols, values)


def token_logprobs(logits, targets):
    """log softmax(logits)[target] per position, in float32, without a (B, L, V) log-softmax."""
    logits = logits.float()
    return logits.gather(-1, targets[..., None])[..., 0] - logits.logsumexp(-1)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


class DataParallel:
    """Hooks for data parallelism; this base class is one process (every hook is identity)."""

    size = 1
    rank = 0

    def wrap(self, model):
        return model

    def wrap_frozen(self, model):
        """The frozen reference model, placed like the policy (identity but under FSDP)."""
        return model

    def no_sync(self, model):
        return _null()

    def release(self, model) -> None:
        """Free what a pass without a backward left gathered (nothing to free here)."""

    def equal_count(self, count: int) -> int:
        """How many micro-batch passes this rank runs (FSDP: the most any rank needs)."""
        return count

    def full_state_dict(self, model) -> dict[str, Any]:
        """The whole state dict on CPU at rank 0 ({} elsewhere)."""
        if self.rank != 0:
            return {}
        return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

    def optimizer_state(self, model, optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state(self, model, optimizer, state) -> None:
        optimizer.load_state_dict(state)

    def load_state_dict(self, model, state, strict: bool = True) -> None:
        model.load_state_dict(state, strict=strict)

    def all_reduce_sum(self, values: Mapping[str, float]) -> dict[str, float]:
        return dict(values)

    def all_reduce_max(self, value: float) -> float:
        return value


class TorchDistributed(DataParallel):
    """``torch.distributed`` data parallelism (DDP) over the process group this process
    joined (:class:`~ray_credit.actors.learner_group.LearnerGroup`'s workers join one)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError(
                "TorchDistributed needs an initialized process group: run the learner in a "
                "LearnerGroup, or call torch.distributed.init_process_group first"
            )
        self._dist = dist
        self.size = dist.get_world_size()
        self.rank = dist.get_rank()

    def wrap(self, model):
        from torch.nn.parallel import DistributedDataParallel

        device = next(model.parameters()).device
        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)

    def no_sync(self, model):
        return model.no_sync()

    def all_reduce_sum(self, values: Mapping[str, float]) -> dict[str, float]:
        import torch

        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
        t = t.to(self._reduce_device())
        self._dist.all_reduce(t)
        return dict(zip(keys, t.tolist(), strict=True))

    def all_reduce_max(self, value: float) -> float:
        import torch

        t = torch.tensor([float(value)], dtype=torch.float64).to(self._reduce_device())
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX)
        return float(t[0])

    def _reduce_device(self):
        """Where small reductions run: NCCL (the backend on GPUs) reduces CUDA tensors only."""
        import torch

        if self._dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


class TorchFSDP(TorchDistributed):
    """Fully sharded data parallelism (FSDP2 ``fully_shard``): each transformer block and
    then the whole model are sharded over the ranks, so parameters, gradients and optimizer
    state take 1/world of the memory each. Same update as DDP on the same data.

    FSDP gathers a block's parameters on every forward, so every rank runs as many
    micro-batch passes as the busiest one (:meth:`equal_count`); the publication and the
    checkpoint gather the full state dict at rank 0 (every rank must take part)."""

    def wrap(self, model):
        from torch.distributed.fsdp import fully_shard

        blocks = set(getattr(model, "_no_split_modules", None) or ())
        for module in model.modules():
            if type(module).__name__ in blocks:
                fully_shard(module)
        fully_shard(model)
        return model

    def wrap_frozen(self, model):
        return self.wrap(model)

    def no_sync(self, model):
        return _FSDPNoSync(model)

    def release(self, model) -> None:
        """Reshard after a pass without a backward: FSDP keeps the root module's own
        parameters (the embeddings, the tied head: 1.2 GB in float32 for Qwen2.5-3B) whole
        after its forward, for a backward that a frozen reference never runs."""
        model.reshard()

    def equal_count(self, count: int) -> int:
        return int(self.all_reduce_max(float(count)))

    def _options(self, **kw):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True, **kw)

    def full_state_dict(self, model) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(model, options=self._options(cpu_offload=True))
        return state if self.rank == 0 else {}

    def optimizer_state(self, model, optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer, options=self._options(cpu_offload=True))

    def load_optimizer_state(self, model, optimizer, state) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, state, options=self._options())

    def load_state_dict(self, model, state, strict: bool = True) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, state, options=self._options(strict=strict))


class _FSDPNoSync:
    """Accumulate gradients locally (no reduce-scatter) until the last micro-batch."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.model.set_requires_gradient_sync(False)

    def __exit__(self, *exc):
        self.model.set_requires_gradient_sync(True)
