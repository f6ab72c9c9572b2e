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
from collections.abc import Iterator, Mapping, Sequence
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
    _fit_and_let_go(trainer)
    metrics = json.loads((Path(out) / _METRICS).read_text())
    (Path(out) / _METRICS).unlink()
    return {**metrics, "seconds": time.perf_counter() - t0}


def _fit_and_let_go(trainer: Any) -> None:
    """``trainer.fit()``, then the SIGINT handler it installs in the main thread put back.
    Ray Train's handler holds the job's controller actor, which therefore outlives the
    job (about 0.4 GB resident beside the RL run that follows a warm-start); with the
    handler gone, Ray reclaims it."""
    import signal
    import threading

    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGINT) if main else None
    try:
        trainer.fit()
    finally:
        if main and before is not None:
            signal.signal(signal.SIGINT, before)


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
        trained_columns,
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
                # only the positions a row learns: the observations between turns
                # need no projection to the vocabulary
                cols = trained_columns(mask[part, span])
                last = i == count - 1
                sync = world.no_sync(model) if not last else _Null()
                with sync, autocast(device, cfg.autocast):
                    outputs = model(input_ids=ids[part, :width].to(device),
                                    attention_mask=attention[part, :width].to(device),
                                    logits_to_keep=(span.start + cols).to(device))  # fmt: skip
                    target = ids[part, span.start + 1 : width][:, cols].to(device)
                    nll = -token_logprobs(outputs.logits, target)
                    m = mask[part, span][:, cols].to(device)
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


_ROLES = {
    "system": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
    "human": "user",  # ShareGPT's names
    "gpt": "assistant",
}
"""The roles a message may have, and what the chat template is given for each."""

_SHAPES = (
    'give {"messages": [{"role": ..., "content": ...}, ...]}, ShareGPT\'s {"conversations": '
    '[{"from": ..., "value": ...}, ...]} or {"prompt": ..., "completion": ...} (both text, '
    "or both lists of messages)"
)


def tokenize_demonstrations(path: str | os.PathLike[str], tokenizer: Any, *, max_tokens: int
                            ) -> list[dict[str, list[int]]]:  # fmt: skip
    """A demonstrations file as rows of ``input_ids`` and ``loss_mask``. The file is JSON
    lines (``.jsonl``, gzipped or not), one JSON array of rows (a file that begins with
    ``[``, gzipped or not) or ``.parquet``; each row is one of:

    * a chat: ``{"messages": [{"role": ..., "content": ...}, ...]}`` (OpenAI, Hugging
      Face; roles system, user, assistant, tool) or ShareGPT's ``{"conversations":
      [{"from": ..., "value": ...}, ...]}`` (roles human, gpt, system). It is rendered by
      the model's chat template, and every assistant message is taught, each from after
      its header to its end-of-turn token; every other token is context. A multi-turn
      chat teaches all its replies, as TRL's SFTTrainer with ``assistant_only_loss``;
    * TRL's conversational prompt/completion, ``{"prompt": [messages], "completion":
      [messages]}``: the prompt is context (its assistant messages too), the completion's
      assistant messages are taught;
    * TRL's standard prompt/completion, ``{"prompt": "...", "completion": "..."}``: the
      completion's tokens and an end-of-sequence token taught.

    A message's other keys (``name``, ``tool_calls``) go to the template as they are; an
    assistant message that calls tools may have a null or empty content beside its
    ``tool_calls``, when the template renders them. A row's other keys (an id, a prompt
    in text beside a chat's messages, a null column of a parquet file) are not read.
    Refused, with the file and line (``F: item N`` in a JSON array, ``F: row N`` in
    parquet, from 0) and what to do: a row of none of these shapes or of two, a row with
    nothing to teach (no assistant message; a null, empty or whitespace-only reply), a
    content that is not a string, a content holding one of the tokenizer's special tokens
    as text (``<|im_end|>``: rendered, it becomes that token, a turn's end inside a
    reply), a role not above, a per-message ``weight`` or ``train`` that is not true,
    false, 1 or 0 or says otherwise than the rule above (it is not read), a chat the
    template cannot render message by message, a file that is one JSON object, and
    demonstrations over ``max_tokens`` (counted; none is cut: a cut one teaches a
    truncated turn). Nothing is skipped but blank lines."""
    from ray_credit.config import InputError
    from ray_credit.data.loaders import _existing

    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise TypeError(f"max_tokens is a whole number of tokens, got {max_tokens!r}")
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
    rows = []
    over: list[tuple[str, int]] = []
    for where, item in _rows(_existing(path, "demonstrations")):
        ids, mask = _demonstration(item, tokenizer, where)
        if len(ids) > max_tokens:
            over.append((where, len(ids)))
        rows.append({"input_ids": ids, "loss_mask": mask})
    if over:
        where, size = over[0]
        longest = max(n for _, n in over)
        others = (
            f" (and {len(over) - 1} more of the {len(rows)} demonstrations, the longest "
            f"{longest} tokens)"
            if len(over) > 1
            else ""
        )
        raise InputError(
            f"{where}: {size} tokens, over --max_tokens {max_tokens}{others}; raise it to "
            f"{longest} or shorten them (none is cut: a cut one teaches a truncated turn)"
        )
    if not rows:
        raise InputError(f"{path}: holds no demonstration (no row); {_SHAPES}")
    return rows


def _rows(path: Path) -> Iterator[tuple[str, dict]]:
    """``(where, row)`` for each row of a demonstrations file, read (and refused: a file
    that is not UTF-8, a line that is not JSON) as the question loaders read theirs."""
    from ray_credit.data.loaders import DataFormatError, _json_lines, _parquet_rows

    if path.suffix == ".parquet":
        for number, row in _parquet_rows(path):
            yield f"{path}: row {number}", row
    elif _is_json_array(path):
        yield from _json_array(path)
    else:
        number = 0
        try:
            for number, row in _json_lines(path):
                yield f"{path}:{number}", row
        except DataFormatError:
            if number == 0:  # its first row: a .json file that holds one object, over lines
                _refuse_one_object(path)
            raise


def _refuse_one_object(path: Path) -> None:
    """Refuse a file whose text is one JSON object (``json.dump({"data": rows}, f,
    indent=2)``), named as that; return for any other file."""
    from ray_credit.data.loaders import DataFormatError, _open_bytes

    try:
        with _open_bytes(path) as stream:
            whole = json.loads(stream.read().decode("utf-8-sig"))
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError):
        return
    if isinstance(whole, dict):
        raise DataFormatError(
            f"{path}: one JSON object over several lines (keys {sorted(whole)[:6]}), not rows"
            f"{_rows_inside(whole)}; a demonstrations file is JSON lines (one row per line) "
            "or one JSON array of rows"
        )


def _is_json_array(path: Path) -> bool:
    """Whether the file's text begins with ``[`` (what ``json.dump(rows, file)`` writes)."""
    from ray_credit.data.loaders import _open_bytes

    try:
        with _open_bytes(path) as stream:
            head = stream.read(1 << 16)
    except (OSError, EOFError):  # damaged gzip data: the JSON lines reader names it
        return False
    return head.removeprefix(b"\xef\xbb\xbf").lstrip()[:1] == b"["


def _json_array(path: Path) -> Iterator[tuple[str, dict]]:
    """The rows of a file that is one JSON array."""
    from ray_credit.data.loaders import (
        _DECODER,
        DataFormatError,
        _json_line,
        _open_bytes,
        _RepeatedKey,
        repeated_key_error,
    )

    try:
        with _open_bytes(path) as stream:
            raw = stream.read()
    except (OSError, EOFError) as err:
        raise DataFormatError(f"{path}: the gzip data is damaged or cut off ({err})") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        # the loaders' message, for the line that holds the byte (its decoding fails too)
        start = raw.rfind(b"\n", 0, err.start) + 1
        end = raw.find(b"\n", err.start)
        _json_line(path, raw.count(b"\n", 0, err.start) + 1, raw[start : None if end < 0 else end])
        raise
    try:
        items = _DECODER.decode(text)
    except json.JSONDecodeError as err:
        raise DataFormatError(
            f"{path}:{err.lineno}: invalid JSON ({err.msg} at column {err.colno}); a file "
            "that begins with '[' is read as one JSON array of rows"
        ) from None
    except _RepeatedKey as err:
        raise repeated_key_error(str(path), err) from None
    for number, item in enumerate(items):
        if not isinstance(item, dict):
            raise DataFormatError(
                f"{path}: item {number}: expected a JSON object, got {type(item).__name__}"
            )
        yield f"{path}: item {number}", item


def _demonstration(item: dict, tokenizer: Any, where: str) -> tuple[list[int], list[int]]:
    """One row's ids and taught-token mask (the shapes of :func:`tokenize_demonstrations`)."""
    from ray_credit.config import InputError
    from ray_credit.data.loaders import _kind

    shapes = [key for key in ("messages", "conversations", "prompt", "completion") if key in item]
    if shapes and all(item[key] is None for key in shapes):  # a parquet file's empty row
        null = " and ".join(repr(key) for key in shapes)
        raise InputError(
            f"{where}: {null} {'is' if len(shapes) == 1 else 'are'} null: nothing to teach; "
            "fill the row in, or drop it"
        )
    chats = [key for key in ("messages", "conversations") if item.get(key) is not None]
    # beside a chat, a prompt in text is the chat's first question (ultrachat's rows), not
    # a demonstration; a completion, or a prompt of messages, is a second one
    beside = [key for key in ("prompt", "completion") if isinstance(item.get(key), (str, list))]
    beside = [key for key in beside if key == "completion" or isinstance(item[key], list)]
    if len(chats) + len(beside[:1]) > 1:
        first, second = [*chats, *beside][:2]
        raise InputError(
            f"{where}: has both {first!r} and {second!r}, two demonstrations in one row; keep "
            "one of them"
        )
    if not chats and not {"prompt", "completion"} & item.keys():
        raise InputError(f"{where}: {_SHAPES}; got keys {sorted(item)[:6]}{_rows_inside(item)}")
    if chats:
        chat = item[chats[0]]
        if not isinstance(chat, list):
            text = isinstance(chat, str) and chat.lstrip().startswith("[")
            raise InputError(
                f"{where}: {chats[0]!r} is a list of messages, got {_kind(chat)}"
                + ("; it is the list's JSON text: store the list itself" if text else "")
            )
        if not chat:
            raise InputError(f"{where}: {chats[0]!r} is an empty list: nothing to teach")
        labels = [f"message {i}" for i in range(len(chat))]
        return _chat(chat, labels, tokenizer, where, taught_from=0)
    if "prompt" not in item:
        raise InputError(
            f'{where}: a completion without a prompt; give the prompt it answers ("prompt": '
            '"" for none)'
        )
    if "completion" not in item:
        raise InputError(
            f"{where}: a prompt without a completion: nothing to teach; add the reply as "
            '"completion"'
        )
    prompt, completion = item["prompt"], item["completion"]
    if isinstance(prompt, list) and isinstance(completion, list):  # TRL's conversational
        if not completion:
            raise InputError(f"{where}: the completion is an empty list: nothing to teach")
        labels = [f"prompt message {i}" for i in range(len(prompt))]
        labels += [f"completion message {i}" for i in range(len(completion))]
        return _chat([*prompt, *completion], labels, tokenizer, where, taught_from=len(prompt))
    if isinstance(prompt, str) and isinstance(completion, str):
        return _text(prompt, completion, tokenizer, where)
    form = "as a list of messages" if isinstance(prompt, list) else "as text"
    if completion is None:
        raise InputError(
            f"{where}: the completion is null, and nothing is taught without one; give the "
            f"reply {form}, or drop the row"
        )
    if prompt is None:
        form = "as a list of messages" if isinstance(completion, list) else 'as text ("" for none)'
        raise InputError(f"{where}: the prompt is null; give it {form}, as the completion is")
    raise InputError(
        f"{where}: prompt and completion are both text (TRL's standard form) or both lists of "
        f"messages (its conversational form), got the prompt {_kind(prompt)} and the "
        f"completion {_kind(completion)}"
    )


def _rows_inside(item: dict) -> str:
    """What a key of an unknown row holds when it looks like rows or a chat, to say so."""
    for key, value in item.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            keys = set().union(*value)
            if {"messages", "conversations", "prompt", "completion"} & keys:
                rows = f"{len(value)} row{'s' if len(value) > 1 else ''}"
                return f" ({key!r} holds {rows}: write them one per line, or as a JSON array)"
            if {"role", "content"} <= keys or {"from", "value"} <= keys:
                return f" ({key!r} holds messages: name it 'messages')"
    return ""


def _special_text(text: str, tokenizer: Any, what: str, where: str) -> None:
    """Refuse text holding a special token (``<|im_end|>``): the tokenizer reads it as that
    token, not as text, so the row would teach (or show) a turn ending mid-message."""
    from ray_credit.config import InputError

    for token in tokenizer.all_special_tokens:
        if token and token in text:
            raise InputError(
                f"{where}: {what} holds {token!r}, a special token of the tokenizer, as text; "
                "it would be read as that token (a turn's end or start inside the message), "
                "not as text: remove it (the template writes the turns' tokens itself)"
            )


def _text(prompt: str, completion: str, tokenizer: Any, where: str) -> tuple[list[int], list[int]]:
    """TRL's standard prompt/completion: the completion and an end-of-sequence token taught."""
    from ray_credit.config import InputError
    from ray_credit.data.loaders import _check_unicode

    _check_unicode(prompt, "the prompt", where)
    _check_unicode(completion, "the completion", where)
    if not completion.strip():
        raise InputError(
            f"{where}: the completion is {'empty' if not completion else 'only whitespace'}: "
            "only the end-of-sequence token would be taught; give the reply, or drop the row"
        )
    if tokenizer.eos_token_id is None:
        raise InputError(
            f"{where}: the tokenizer has no end-of-sequence token to end the completion with; "
            "give chats (messages), or a model whose tokenizer has one"
        )
    _special_text(prompt, tokenizer, "the prompt", where)
    _special_text(completion, tokenizer, "the completion", where)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer = [*tokenizer(completion, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    return [*prompt_ids, *answer], [0] * len(prompt_ids) + [1] * len(answer)


def _message(message: Any, label: str, where: str) -> dict:
    """A message as the chat template takes it: ``role`` (ShareGPT's ``from``, its names
    mapped) and ``content`` (ShareGPT's ``value``), its other keys as they are."""
    from ray_credit.config import InputError
    from ray_credit.data.loaders import _check_unicode, _kind

    if not isinstance(message, dict):
        raise InputError(
            f"{where}: {label} is {_kind(message)}, not an object with a role and a content"
        )
    sharegpt = "role" not in message and "content" not in message
    role_key, content_key = ("from", "value") if sharegpt else ("role", "content")
    if role_key not in message or content_key not in message:
        raise InputError(
            f'{where}: {label} needs a role and a content ({{"role": ..., "content": ...}}, or '
            f'ShareGPT\'s {{"from": ..., "value": ...}}); got keys {sorted(message)[:6]}'
        )
    role, content = message[role_key], message[content_key]
    if not isinstance(role, str) or role not in _ROLES:
        near = role.strip().lower() if isinstance(role, str) else None
        meant = f" (did you mean {near!r}?)" if near in _ROLES else ""
        raise InputError(
            f"{where}: {label} has the role {role!r}{meant}; a role is system, user, assistant "
            "or tool (ShareGPT's human and gpt)"
        )
    role = _ROLES[role]
    calls = role == "assistant" and bool(message.get("tool_calls"))
    if content is None and calls:
        content = ""  # OpenAI's tool call: the calls are the reply (templates add strings)
    if not isinstance(content, str):
        got = "a null content" if content is None else f"the content {_kind(content)}"
        raise InputError(f"{where}: {label} ({role}) has {got}; give its text as a string")
    _check_unicode(content, f"{label}'s content", where)
    if role == "assistant" and not content.strip() and not calls:
        raise InputError(
            f"{where}: {label} is an assistant reply that is "
            f"{'empty' if not content else 'only whitespace'}: nothing to teach; give the "
            "reply, or drop the message"
        )
    # a null key is an absent one (a parquet file's struct has every message's keys)
    rest = {k: v for k, v in message.items() if k not in (role_key, content_key) and v is not None}
    return {**rest, "role": role, "content": content}


def _chat(chat: list, labels: list[str], tokenizer: Any, where: str, *, taught_from: int
          ) -> tuple[list[int], list[int]]:  # fmt: skip
    """The chat's ids with each assistant message from ``taught_from`` on taught, from
    after its header (the template's generation prompt) to its end. The template is
    rendered up to each message, each rendering a prefix of the next, so every token is
    the one the whole chat renders."""
    from ray_credit.config import InputError

    messages = [_message(m, label, where) for m, label in zip(chat, labels, strict=True)]
    taught = [m["role"] == "assistant" and i >= taught_from for i, m in enumerate(messages)]
    if not any(taught):
        roles = ", ".join(dict.fromkeys(m["role"] for m in messages[taught_from:]))
        raise InputError(
            f"{where}: no assistant message to teach ({'its completion' if taught_from else 'it'}"
            f" has {roles}); add the reply the model should give (role assistant, ShareGPT's gpt)"
        )
    if taught[0]:
        raise InputError(
            f"{where}: {labels[0]} is the assistant's, with nothing before it that it answers; "
            "put the user's message (or a system one) first"
        )
    for message, label, teach in zip(messages, labels, taught, strict=True):
        _special_text(message["content"], tokenizer, f"{label}'s content", where)
        for flag in ("weight", "train"):  # another trainer's per-message switch: not read
            value = message.get(flag)
            role = message["role"]
            # "0", "false", 0.5 or NaN were read as true: taught, whatever they meant
            if value is not None and not (isinstance(value, bool) or value in (0, 1)):
                untaught = (
                    ' (a reply not to teach goes in the prompt of {"prompt": [messages], '
                    '"completion": [messages]})'
                    if role == "assistant"
                    else ""
                )
                raise InputError(
                    f"{where}: {label} ({role}) has {flag}={value!r}, and a per-message {flag} "
                    "is not read: every assistant reply"
                    f"{' of the completion' if taught_from else ''} is taught in full and "
                    f"nothing else; remove {flag!r}{untaught}"
                )
            if value is None or bool(value) == teach:
                continue
            fix = (
                'put it in the prompt of {"prompt": [messages], "completion": [messages]} '
                f"(only the completion's replies are taught), or remove {flag!r}"
                if teach
                else f"remove {flag!r}"
            )
            raise InputError(
                f"{where}: {label} ({role}) has {flag}={value!r}, and a per-message {flag} is "
                f"not read: every assistant reply{' of the completion' if taught_from else ''} "
                f"is taught and nothing else, so this one {'is' if teach else 'is not'}; {fix}"
            )
    template = [{k: v for k, v in m.items() if k not in ("weight", "train")} for m in messages]
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    mask: list[int] = []
    for i, (label, teach) in enumerate(zip(labels, taught, strict=True)):
        upto = _rendered(tokenizer, template[: i + 1], where)
        role = messages[i]["role"]
        if upto[: len(ids)] != ids:
            raise InputError(
                f"{where}: the chat template renders {label} so that the tokens before it "
                "change; this template cannot be taught message by message"
            )
        if len(upto) == len(ids):
            raise InputError(
                f"{where}: the chat template renders {label} ({role}) as nothing (it leaves "
                f"{role} messages out); drop them, or use a model whose template renders them"
            )
        start = len(upto)
        if teach:  # the assistant's header is not taught, only what the model says
            header = _rendered(tokenizer, template[:i], where, generation_prompt=True)
            if not (len(ids) <= len(header) < len(upto) and upto[: len(header)] == header):
                raise InputError(
                    f"{where}: the chat template begins {label} otherwise than with its "
                    "generation prompt; this template cannot be taught message by message"
                )
            start = len(header)
        end = _turn_end(upto, start, eos) if teach else len(upto)
        if teach and all(t == eos for t in upto[start:end]):
            left_out = " (it leaves out tool_calls)" if messages[i].get("tool_calls") else ""
            raise InputError(
                f"{where}: the chat template renders {label} (assistant) as nothing but its "
                f"end of turn{left_out}: nothing to teach there; give the reply as text, or use "
                "a model whose template renders it"
            )
        mask += [0] * (start - len(ids)) + [1] * (end - start) + [0] * (len(upto) - end)
        ids = upto
    return ids, mask


def _turn_end(ids: list[int], start: int, eos: int | None) -> int:
    """Where an assistant message's taught tokens end: after its end-of-turn token (the
    tokenizer's end of sequence, where generation stops) when it has one; what the
    template writes after it (ChatML's newline) is never generated, so it is context, as
    in TRL's training templates."""
    after = [i for i in range(start, len(ids)) if ids[i] == eos]
    return after[-1] + 1 if after else len(ids)


def _rendered(tokenizer: Any, messages: list[dict], where: str, *,
              generation_prompt: bool = False) -> list[int]:  # fmt: skip
    from ray_credit.config import InputError

    if tokenizer.chat_template is None:
        raise InputError(
            f"{where}: the model's tokenizer has no chat template to render a chat with; "
            'give the rows as text ({"prompt": "...", "completion": "..."}), or a model that '
            "has one (an instruct model)"
        )
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
    except Exception as err:  # jinja's errors (a template's raise_exception), no template
        raise InputError(
            f"{where}: the model's chat template cannot render this chat "
            f"({type(err).__name__}: {err}); give the chat as the template takes it (its "
            "roles and their order), or a model whose template renders it"
        ) from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]


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
