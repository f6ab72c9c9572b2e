"""Supervised fine-tuning as a Ray Train job: the warm-start's fine-tuning and
``pipelines/sft.py``.

:func:`fine_tune` runs a ``TorchTrainer``: ``workers`` processes (Ray Train joins them in
one process group: gloo on CPUs, NCCL on GPUs), data parallel (DDP) or fully sharded
(FSDP2, the learner's own :class:`~ray_credit.actors.learner.TorchFSDP`). Every rank walks
the same shuffled order; each optimizer step's demonstrations are split over the ranks,
and each rank's loss is scaled so that the averaged gradient is the one-process gradient
of the token-mean cross-entropy over the step's taught tokens (``loss_mask`` times the
turn's weight). After every epoch the model and optimizer state are reported as a Ray
Train checkpoint under ``storage_path/name`` (a path every node sees, or a URI); a worker
that dies makes Ray Train restart the group from the newest one (``max_failures``), and a
job started again with the same storage and name resumes there. Rank 0 saves the final
policy as a Hugging Face folder. Checkpoints hold tensors only (safetensors, and the
optimizer's state read with ``weights_only=True``): nothing is unpickled.

Why the RL learner is not a Ray Train job: its updates interleave with generation under a
staleness bound, it publishes weights to the generators after each step and is driven
step by step by the pipeline's loop (docs/architecture.md). A supervised fine-tuning is
one fit from start to end, which is what Ray Train runs.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ray_credit.batch import TrajectoryBatch
from ray_credit.config import check_fields
from ray_credit.models import Autocast

__all__ = ["FitConfig", "fine_tune", "tokenize_demonstrations"]

_METRICS = "sft_metrics.json"


@dataclass(frozen=True)
class FitConfig:
    """How :func:`fine_tune` trains and where it runs."""

    epochs: int = 2
    lr: float = 1e-4
    """Peak AdamW learning rate (linear decay to 0 over the fit)."""
    batch_size: int = 16
    """Demonstrations per optimizer step (over all workers)."""
    micro_batch_tokens: int = 4096
    autocast: Autocast | None = None
    seed: int = 0
    workers: int = 1
    strategy: Literal["ddp", "fsdp"] = "ddp"
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 1.0
    learner_resource: str | None = None
    """A custom resource each worker asks one unit of (a cluster's 'learner')."""
    max_failures: int = 1
    """Restarts of the worker group from its newest checkpoint after a worker dies."""

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("epochs", "batch_size", "micro_batch_tokens", "workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def fine_tune(
    model: str,
    demos: TrajectoryBatch | Sequence[Mapping[str, Sequence[int]]],
    cfg: FitConfig,
    *,
    pad_token_id: int,
    storage_path: str,
    name: str,
    out: str | os.PathLike[str],
) -> dict[str, Any]:
    """Fine-tune ``model`` on ``demos`` as a Ray Train job, saving the result as a model
    folder in ``out``; returns its metrics: the loss per epoch, optimizer steps, the
    epoch it resumed from and the seconds it took. ``demos``: a TrajectoryBatch (its
    ``loss_mask`` times ``advantages`` weighs each token), or rows of ``input_ids`` and
    ``loss_mask`` (:func:`tokenize_demonstrations`)."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from ray_credit.models import cpu_rehearsal

    resources = {"CPU": cfg.cpus_per_worker}
    if cfg.learner_resource:
        resources[cfg.learner_resource] = 1.0
    if cfg.use_gpu:
        resources["GPU"] = cfg.gpus_per_worker
    trainer = TorchTrainer(
        _train_loop,
        train_loop_config={
            "model": model,
            "demos": ray.put(demos),
            "cfg": cfg,
            "pad": int(pad_token_id),
            "out": str(out),
        },  # fmt: skip
        # gloo on CPUs, and in a rehearsal on logical GPUs; else NCCL
        torch_config=TorchConfig(backend="nccl" if cfg.use_gpu and not cpu_rehearsal() else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=cfg.workers, use_gpu=cfg.use_gpu, resources_per_worker=resources
        ),
        run_config=RunConfig(
            name=name,
            storage_path=storage_path,
            failure_config=FailureConfig(max_failures=cfg.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=1),
        ),
    )
    t0 = time.perf_counter()
    trainer.fit()
    metrics = json.loads((Path(out) / _METRICS).read_text())
    (Path(out) / _METRICS).unlink()
    return {**metrics, "seconds": time.perf_counter() - t0}


def _train_loop(config: dict) -> None:
    """One Ray Train worker (module docstring)."""
    import ray
    import ray.train
    import torch

    from ray_credit.actors.learner import (
        DataParallel,
        TorchDistributed,
        TorchFSDP,
        autocast,
        micro_batches,
        token_logprobs,
        trained_span,
    )
    from ray_credit.models import cpu_rehearsal, load_model

    cfg: FitConfig = config["cfg"]
    ctx = ray.train.get_context()
    rank, size = ctx.get_world_rank(), ctx.get_world_size()
    on_gpu = cfg.use_gpu and not cpu_rehearsal()
    device = ray.train.torch.get_device() if on_gpu else torch.device("cpu")
    if cfg.strategy == "fsdp":
        world = TorchFSDP()
    else:
        world = TorchDistributed() if size > 1 else DataParallel()
    policy, _ = load_model(config["model"], device=str(device))
    ids, attention, taught = _tensors(ray.get(config["demos"]), config["pad"])
    mask = taught[:, 1:]
    lengths = attention.sum(-1)
    n = len(ids)
    steps_per_epoch = math.ceil(n / cfg.batch_size)
    total = steps_per_epoch * cfg.epochs
    model = world.wrap(policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / total)
    start_epoch, losses = 0, []
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:  # a restart after a failure, or the same job run again
        with checkpoint.as_directory() as folder:
            start_epoch, losses = _load(Path(folder), policy, optimizer, schedule, world)
    rng = np.random.default_rng(cfg.seed)
    orders = [rng.permutation(n) for _ in range(cfg.epochs)]  # the same on every rank
    for epoch in range(start_epoch, cfg.epochs):
        epoch_loss, epoch_tokens = 0.0, 0.0
        for step_rows in np.array_split(orders[epoch], steps_per_epoch):
            tokens = float(mask[step_rows].sum())  # the step's, over every rank
            rows = np.array_split(step_rows, size)[rank]
            optimizer.zero_grad(set_to_none=True)
            passes = list(micro_batches(lengths[rows].numpy(), cfg.micro_batch_tokens))
            count = world.equal_count(len(passes))  # FSDP: every rank runs as many
            for i in range(count):
                # a rank with fewer passes repeats its first with weight 0 (or row 0 of
                # the step when it has none): every rank takes part in each collective
                weight = 1.0 if i < len(passes) else 0.0
                part = rows[passes[min(i, len(passes) - 1)]] if passes else step_rows[:1]
                width = int(lengths[part].max())
                span = trained_span(mask[part], width)
                last = i == count - 1
                sync = world.no_sync(model) if not last else _Null()
                with sync, autocast(device, cfg.autocast):
                    outputs = model(input_ids=ids[part, :width].to(device),
                                    attention_mask=attention[part, :width].to(device),
                                    logits_to_keep=width - span.start)  # fmt: skip
                    target = ids[part, span.start + 1 : width].to(device)
                    nll = -token_logprobs(outputs.logits[:, :-1], target)
                    m = mask[part, span].to(device)
                    loss = (nll * m).sum() * (weight * size / max(tokens, 1.0))
                    loss.backward()
                epoch_loss += weight * float((nll.detach() * m).sum())
            epoch_tokens += tokens
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
        summed = world.all_reduce_sum({"loss": epoch_loss})["loss"]
        losses.append(summed / max(epoch_tokens, 1.0))
        _report(epoch, losses, policy, optimizer, schedule, world, rank)
    state = world.full_state_dict(policy)  # every rank takes part; rank 0 holds it
    if rank == 0:
        _save_policy(config, policy, state, losses, total, start_epoch)


def _tensors(demos: Any, pad: int) -> tuple[Any, Any, Any]:
    """(input ids, attention mask, taught-token weights), right-padded."""
    import torch

    if isinstance(demos, TrajectoryBatch):
        t = demos.to_torch(pad_token_id=pad)
        return t["input_ids"], t["attention_mask"], t["loss_mask"] * t["advantages"]
    width = max(len(row["input_ids"]) for row in demos)
    ids = torch.full((len(demos), width), pad, dtype=torch.long)
    attention = torch.zeros((len(demos), width), dtype=torch.long)
    taught = torch.zeros((len(demos), width), dtype=torch.float32)
    for i, row in enumerate(demos):
        n = len(row["input_ids"])
        ids[i, :n] = torch.tensor(row["input_ids"])
        attention[i, :n] = 1
        taught[i, :n] = torch.tensor(row["loss_mask"], dtype=torch.float32)
    return ids, attention, taught


def tokenize_demonstrations(path: str | os.PathLike[str], tokenizer: Any, *, max_tokens: int
                            ) -> list[dict[str, list[int]]]:  # fmt: skip
    """A demonstrations file (jsonl) as rows of ``input_ids`` and ``loss_mask``. Each line
    is ``{"messages": [{"role": ..., "content": ...}, ...]}`` (chat: the model's template,
    the assistant's messages taught) or ``{"prompt": ..., "completion": ...}`` (plain
    text: the completion and an end-of-sequence token taught). A line that is neither, a
    demonstration longer than ``max_tokens`` or one with nothing to teach is refused with
    its line number."""
    from ray_credit.config import InputError

    rows = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                item = json.loads(line)
            except json.JSONDecodeError as err:
                raise InputError(f"{where}: not a JSON object ({err.msg})") from None
            if isinstance(item, dict) and isinstance(item.get("messages"), list):
                ids, mask = _chat(item["messages"], tokenizer, where)
            elif isinstance(item, dict) and {"prompt", "completion"} <= item.keys():
                prompt = tokenizer(str(item["prompt"]), add_special_tokens=False)["input_ids"]
                answer = tokenizer(str(item["completion"]), add_special_tokens=False)["input_ids"]
                answer = [*answer, tokenizer.eos_token_id]
                ids, mask = [*prompt, *answer], [0] * len(prompt) + [1] * len(answer)
            else:
                raise InputError(
                    f'{where}: give {{"messages": [{{"role": ..., "content": ...}}]}} or '
                    f'{{"prompt": ..., "completion": ...}}, got keys {sorted(item)[:6]}'
                    if isinstance(item, dict) else f"{where}: not a JSON object"
                )  # fmt: skip
            if len(ids) > max_tokens:
                raise InputError(
                    f"{where}: {len(ids)} tokens, over --max_tokens {max_tokens}; raise it or "
                    "shorten the demonstration (none is cut: a cut one teaches a truncated turn)"
                )
            if not any(mask):
                raise InputError(f"{where}: has no assistant message or completion to teach")
            rows.append({"input_ids": ids, "loss_mask": mask})
    if not rows:
        raise InputError(f"{path}: holds no demonstration")
    return rows


def _chat(messages: list, tokenizer: Any, where: str) -> tuple[list[int], list[int]]:
    """The chat's ids, each assistant message's tokens taught: the template rendered up
    to each message, each rendering a prefix of the next."""
    from ray_credit.config import InputError

    ids: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or {"role", "content"} - message.keys():
            raise InputError(f"{where}: message {i} needs a role and a content")
        rendered = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        upto = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        if upto[: len(ids)] != ids:
            raise InputError(
                f"{where}: the chat template renders message {i} so that the tokens before it "
                "change; this template cannot be taught message by message"
            )
        taught = 1 if message["role"] == "assistant" else 0
        if taught:  # the assistant header is not taught, only what the model says
            header = tokenizer.apply_chat_template(messages[:i], tokenize=False,
                                                   add_generation_prompt=True) if i else ""  # fmt: skip
            start = len(tokenizer(header, add_special_tokens=False)["input_ids"]) if i else 0
            start = max(start, len(ids))
        else:
            start = len(upto)
        mask += [0] * (start - len(ids)) + [taught] * (len(upto) - start)
        ids = upto
    return ids, mask


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _report(epoch, losses, model, optimizer, schedule, world, rank) -> None:
    # ``model``: the policy itself (DDP's wrapper would prefix every key with "module.")
    """The epoch's loss, with a checkpoint of the model, optimizer and schedule."""
    import ray.train
    import torch
    from safetensors.torch import save_file

    state = world.full_state_dict(model)
    optim = world.optimizer_state(model, optimizer)
    with tempfile.TemporaryDirectory() as folder:
        if rank == 0:
            save_file({k: v.contiguous() for k, v in state.items()}, f"{folder}/model.safetensors")
            torch.save({"optimizer": optim, "schedule": schedule.state_dict()},
                       f"{folder}/optimizer.pt")  # fmt: skip
            Path(folder, "progress.json").write_text(json.dumps({"epoch": epoch, "losses": losses}))
        checkpoint = ray.train.Checkpoint.from_directory(folder) if rank == 0 else None
        ray.train.report({"epoch": epoch + 1, "loss": losses[-1]}, checkpoint=checkpoint)


def _load(folder: Path, model, optimizer, schedule, world) -> tuple[int, list[float]]:
    import torch
    from safetensors.torch import load_file

    world.load_state_dict(model, load_file(str(folder / "model.safetensors")))
    saved = torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=True)
    world.load_optimizer_state(model, optimizer, saved["optimizer"])
    schedule.load_state_dict(saved["schedule"])
    progress = json.loads((folder / "progress.json").read_text())
    return int(progress["epoch"]) + 1, list(progress["losses"])


def _save_policy(config, policy, state, losses, total, start_epoch) -> None:
    """The fitted policy as a model folder (float32 weights) in ``out``, and the metrics
    the driver reads back."""
    from ray_credit.models import load_tokenizer

    out = Path(config["out"])
    out.mkdir(parents=True, exist_ok=True)
    policy.save_pretrained(out, state_dict=state, safe_serialization=True)
    load_tokenizer(config["model"]).save_pretrained(out)
    metrics = {"loss_per_epoch": losses, "optimizer_steps": total, "resumed_epoch": start_epoch}
    (out / _METRICS).write_text(json.dumps(metrics))
