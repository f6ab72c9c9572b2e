"""What each GPU of a run will hold, estimated before Ray starts.

From the policy's ``config.json`` (a model folder's, or the Hugging Face cache's: nothing
is downloaded) and the run's settings: a learner worker holds its share of the weights,
gradients and AdamW state in ``learner.dtype`` (all of them, or 1/N under FSDP over N
workers; with LoRA only the adapters train), the frozen reference of a KL loss, and its
micro-batch's activations and float32 logits; a vLLM generator takes
``gpu_memory_utilization`` of its GPU (its share of it, beside the scorer), the weights
first and the KV cache the rest; the info-gain scorer holds the policy's weights; with
``resources.retriever_gpu_share`` every learner and generator GPU also holds an index
slice (its rows in float16, and a search's scores). Each is
an estimate: it is printed as a table, and a GPU it will not fit gets a warning that says
what to change.

The learner's transient terms are measured, not derived: what the update keeps for the
backward pass per token and layer (counted as 36 bytes per hidden unit and 8 per
intermediate unit under bf16 autocast), per logit (16 bytes: the bf16 projection, its
float32 copy, the log-softmax and their gradients), the bf16 copies of float32 weights that
autocast saves for the backward pass (half the weights' bytes: the whole model's, or with
gradient checkpointing one block's) and at AdamW's step (temporaries 1.3 times one moment
of its state) were read off the learner's live tensors on a CPU
(``bench/memory_terms.py``), and the totals checked against one H200
(``bench/gpu_check.py --only scale``), where the estimate covered the peak of a learner
without a KL reference. The frozen reference of a KL term is counted as a copy of the
weights in ``learner.reference_dtype`` (sharded like the policy under FSDP); that run's
figures for the KL cases held the previous case's learner too (the check kept it alive
until the garbage collector ran), so they do not measure it. The GPU's memory is ``resources.gpu_memory_gb``, else what
``nvidia-smi`` reports on this machine (no CUDA call), else unknown (no check).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray_credit.log import log

__all__ = [
    "ModelShape",
    "estimate",
    "gpu_memory_gb",
    "index_vectors",
    "model_shape",
    "report_memory",
    "SLICE_BATCH",
    "slice_bytes",
]

GB = 1024**3
_VLLM_OVERHEAD_GB = 2.0  # CUDA context, graphs and the sampler's buffers, per engine
_LEARNER_OVERHEAD_GB = 1.0  # CUDA context and the allocator's slack, per worker
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2, "native": 2}  # GPUs: bf16
# Measured (bench/memory_terms.py): what an update holds per position and vocabulary entry
# (bytes, forward and backward), and per token and layer the elements (in the activations'
# dtype) per hidden and per intermediate unit that a block keeps for its backward.
_LOGIT_BYTES = 16
_LAYER_HIDDEN = 18
_LAYER_INTERMEDIATE = 4
_ADAMW_STEP = 1.3  # AdamW's step: temporaries over the bytes of one moment of its state
# Under autocast, float32 weights are cast to bf16 for each matmul and those copies are
# saved for the backward pass (measured: 0.5 of the float32 weights' bytes): the whole
# model's, unsharded even under FSDP; with gradient checkpointing, the recomputed block's.
_AUTOCAST_COPIES = 0.5


@dataclass(frozen=True)
class ModelShape:
    """What the memory of a decoder-only transformer depends on."""

    params: int
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        text = config.get("text_config", config)  # multimodal configs nest the LM's
        h, layers = int(text["hidden_size"]), int(text["num_hidden_layers"])
        heads = int(text["num_attention_heads"])
        kv = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or h // heads)
        inter = int(text.get("intermediate_size") or 4 * h)
        vocab = int(text["vocab_size"])
        attention = h * heads * head_dim * 2 + h * kv * head_dim * 2  # q, o; k, v
        per_layer = attention + 3 * h * inter + 2 * h  # gated MLP, two norms
        tied = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        params = layers * per_layer + vocab * h * (1 if tied else 2) + h
        return cls(params, layers, h, inter, vocab, kv, head_dim)


def model_shape(model: str) -> ModelShape | None:
    """The shape of ``model`` (a folder with config.json, or a hub id already in the
    Hugging Face cache); None where its config cannot be read without a download."""
    path = Path(model) / "config.json"
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(model, "config.json")
        except Exception:  # not an id the hub library takes
            return None
        if not isinstance(cached, str):
            return None
        path = Path(cached)
    try:
        return ModelShape.from_config(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def gpu_memory_gb(res: Any) -> float | None:
    """``resources.gpu_memory_gb``, else the smallest GPU ``nvidia-smi`` lists here."""
    if getattr(res, "gpu_memory_gb", None) is not None:
        return float(res.gpu_memory_gb)
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout  # fmt: skip
        sizes = [float(line) / 1024 for line in out.split() if line.strip()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return min(sizes) if sizes else None


def _lora_params(shape: ModelShape, rank: int) -> int:
    """Adapter parameters of rank ``rank`` on every linear layer of every block."""
    h, kv, inter = shape.hidden, shape.kv_heads * shape.head_dim, shape.intermediate
    per_layer = rank * ((h + h) * 2 + (h + kv) * 2 + (h + inter) * 3)
    return shape.layers * per_layer


SLICE_BATCH = 256
"""The most queries one search of the slices holds: the retriever's batch (its
``max_batch_queries``)."""


def slice_bytes(cfg: Any, index_vectors: tuple[int, int] | None) -> float:
    """What one index slice holds on its GPU (``resources.retriever_gpu_share``; 0
    without): its rows of the ``index_vectors`` (count, dimension) in float16, and what a
    search of the retriever's largest batch takes beside them (a chunk of scores, its
    masks, the top-k)."""
    from ray_credit.pipeline.placement import slice_hosts

    if index_vectors is None:
        return 0.0
    hosts = len(slice_hosts(cfg))
    if not hosts:
        return 0.0
    import torch

    from ray_credit.actors.flat_slices import FlatSlice

    count, dim = index_vectors
    rows = -(-count // hosts)
    k = cfg.generator.topk
    return rows * dim * 2 + FlatSlice.workspace_bytes(SLICE_BATCH, k, dim=dim, dtype=torch.float16)


def index_vectors(cfg: Any, corpus: Any) -> tuple[int, int] | None:
    """(count, dimension) of the index of a run with ``resources.retriever_gpu_share``,
    without opening it: the imported file's header, the index folder's manifest, else the
    corpus's passages at the encoder's dimension (None: unknown, or no share)."""
    from ray_credit.actors.corpus import count_docs
    from ray_credit.actors.dense_index import read_manifest
    from ray_credit.actors.encoder import encoder_dim

    retriever = cfg.retriever
    if not cfg.resources.retriever_gpu_share or retriever.url:
        return None
    if retriever.index_file:
        try:
            from ray_credit.actors.flat_slices import read_flat_layout

            layout = read_flat_layout(retriever.index_file)
            return layout.ntotal, layout.dim
        except (OSError, ValueError):  # not a flat file: refused where it is opened
            pass
    if retriever.index_folder:
        manifest = read_manifest(retriever.index_folder)
        if manifest is not None:
            return int(manifest["num_docs"]), int(manifest["dim"])
    dim = encoder_dim(retriever.encoder)
    return None if dim is None else (count_docs(corpus), dim)


def estimate(
    cfg: Any,
    shape: ModelShape,
    gpu_gb: float | None,
    services: tuple[str, ...] = (),
    index: tuple[int, int] | None = None,
) -> list[dict[str, Any]]:
    """One row per kind of GPU holder: its name, its parts in GB and their total, and the
    GPU memory it has to fit in (None: unknown). ``services``: the plan's (with the
    scorer on generator 0's GPU, generator 0 has the rest of it). ``index``: the index's
    (count, dimension), whose slices a ``resources.retriever_gpu_share`` puts beside
    each learner and generator."""
    res, lr, gen = cfg.resources, cfg.learner, cfg.generator
    piece = slice_bytes(cfg, index)
    rows = []
    if res.use_gpu:
        shards = res.learner_workers if res.learner_strategy == "fsdp" else 1
        pbytes = _BYTES[lr.dtype]
        weights = shape.params * pbytes / shards
        if lr.lora.rank > 0:
            trained = _lora_params(shape, lr.lora.rank) / shards
            grads, adam, reference = trained * 4, trained * 8, 0.0  # float32 adapters
        else:
            grads, adam = weights, 2 * weights  # AdamW's two moments, in the weights' dtype
            ref_bytes = _BYTES[lr.reference_dtype or lr.dtype]
            reference = shape.params * ref_bytes / shards if lr.kl_coef > 0 else 0.0
        tokens = lr.micro_batch_tokens
        abytes = 2 if lr.autocast else pbytes  # 'auto': bf16 on GPUs that have it
        layer = shape.hidden * _LAYER_HIDDEN + shape.intermediate * _LAYER_INTERMEDIATE
        if lr.gradient_checkpointing:  # each block's input (the residual stream) and one block
            acts = tokens * (shape.hidden * shape.layers * pbytes + layer * abytes)
        else:
            acts = tokens * layer * shape.layers * abytes
        logits = tokens * shape.vocab * _LOGIT_BYTES
        gathered = 2 * (shape.params / shape.layers) * pbytes if shards > 1 else 0.0
        copies = 0.0
        if lr.autocast and pbytes == 4:
            copied = shape.params / shape.layers if lr.gradient_checkpointing else shape.params
            copies = _AUTOCAST_COPIES * 4 * copied
        parts = {"weights": weights, "gradients": grads, "AdamW": adam, "reference": reference,
                 "activations": acts + logits + gathered + copies,
                 "AdamW step": _ADAMW_STEP * adam / 2,
                 "overhead": _LEARNER_OVERHEAD_GB * GB, "index slice": piece}  # fmt: skip
        how = f"{res.learner_strategy} over {shards}" if shards > 1 else "a whole replica"
        rows.append(_row(f"learner worker ({how}, {lr.dtype})", parts, gpu_gb))
    if res.generator_gpus:
        from ray_credit.pipeline.placement import scorer_shares_gpu

        share = 1.0
        if "scorer" in services and scorer_shares_gpu(res):
            share = res.generator_gpus - res.scorer_gpus
        tp = gen.vllm.tensor_parallel_size
        weights = shape.params * _BYTES[gen.dtype] / tp
        if gen.backend == "vllm":
            budget = (
                None if gpu_gb is None else gpu_gb * GB * gen.vllm.gpu_memory_utilization * share
            )
            kv_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * _BYTES[gen.dtype] / tp
            parts = {"weights": weights, "overhead": _VLLM_OVERHEAD_GB * GB}
            row = _row(f"generator (vLLM, {gen.dtype}, tp {tp})", parts, gpu_gb)
            if budget is not None:
                kv = budget - weights - _VLLM_OVERHEAD_GB * GB
                row["kv_gb"] = kv / GB
                row["kv_tokens"] = int(max(kv, 0) // kv_token)
                row["contexts"] = row["kv_tokens"] // gen.max_context_tokens
                row["budget_gb"] = budget / GB
            if piece:  # outside the engine's budget: beside it on the GPU
                row["slice_gb"] = piece / GB
            rows.append(row)
        else:
            parts = {"weights": weights, "KV kept between turns": gen.kv_reuse_gb * GB,
                     "index slice": piece}  # fmt: skip
            rows.append(_row(f"generator (transformers, {gen.dtype})", parts, gpu_gb))
    return rows


def _row(name: str, parts: dict[str, float], gpu_gb: float | None) -> dict[str, Any]:
    parts_gb = {k: v / GB for k, v in parts.items() if v}
    return {"name": name, "parts": parts_gb, "total": sum(parts_gb.values()), "gpu_gb": gpu_gb}


def report_memory(
    cfg: Any, services: set[str] = frozenset(), index: tuple[int, int] | None = None
) -> list[str]:
    """Print the estimate per GPU (and warn where it will not fit); returns the warnings.
    Nothing to print for a run without GPUs or a policy whose config.json is not at hand.
    ``index``: (count, dimension) of the index, for the slices of a GPU share
    (:func:`index_vectors`)."""
    res = cfg.resources
    if not (res.use_gpu or res.generator_gpus):
        return []
    shape = model_shape(cfg.model)
    if shape is None:
        log.info(f"memory per GPU: not estimated ({cfg.model}'s config.json is not on this "
                 "machine yet; it is read from a model folder or the Hugging Face cache)")  # fmt: skip
        return []
    gpu_gb = gpu_memory_gb(res)
    rows = estimate(cfg, shape, gpu_gb, tuple(services), index)
    if slice_bytes(cfg, (1, 1)) and index is None:
        log.info("memory per GPU: the index slices are not counted (the index's dimension "
                 "is not known before it is built; the encoder's files are not here)")  # fmt: skip
    size = f"{gpu_gb:.0f} GB GPUs" if gpu_gb else "GPU size unknown: --resources.gpu_memory_gb"
    lines = [f"memory per GPU ({cfg.model}: {shape.params / 1e9:.2f}B parameters; {size}):"]
    warnings = []
    for row in rows:
        parts = " + ".join(f"{k} {v:.1f}" for k, v in row["parts"].items())
        line = f"  {row['name']}: {parts} = {row['total']:.1f} GB" + (
            f" of {row['gpu_gb']:.0f}" if row["gpu_gb"] and "kv_tokens" not in row else ""
        )
        if "kv_tokens" in row:
            line += (f"; KV cache {row['kv_gb']:.1f} GB of its {row['budget_gb']:.1f}: "
                     f"{row['kv_tokens']:,} tokens, {row['contexts']} full contexts of "
                     f"{cfg.generator.max_context_tokens}")  # fmt: skip
            if "slice_gb" in row:
                beside = row["budget_gb"] + row["slice_gb"]
                line += f"; beside it an index slice {row['slice_gb']:.1f} GB"
                if row["gpu_gb"] is not None and beside > row["gpu_gb"]:
                    most = (row["gpu_gb"] - row["slice_gb"]) / row["gpu_gb"]
                    warnings.append(
                        f"warning: a generator's vLLM engine takes {row['budget_gb']:.1f} GB "
                        f"(generator.vllm.gpu_memory_utilization="
                        f"{cfg.generator.vllm.gpu_memory_utilization:g}) and its GPU's index "
                        f"slice {row['slice_gb']:.1f} GB: {beside:.1f} GB of a "
                        f"{row['gpu_gb']:.0f} GB GPU; set --generator.vllm."
                        f"gpu_memory_utilization {math.floor(most * 100) / 100:.2f} or less"
                    )
            if row["contexts"] < 1:
                warnings.append(
                    f"warning: a generator's KV cache ({row['kv_gb']:.1f} GB) cannot hold one "
                    f"trajectory of {cfg.generator.max_context_tokens} tokens: raise "
                    "--generator.vllm.gpu_memory_utilization, use tensor parallelism "
                    "(--generator.vllm.tensor_parallel_size with as many resources.generator_gpus), "
                    "or lower --generator.max_context_tokens"
                )
        elif row["gpu_gb"] is not None and row["total"] > row["gpu_gb"]:
            warnings.append(
                f"warning: a {row['name']} needs about {row['total']:.1f} GB of a "
                f"{row['gpu_gb']:.0f} GB GPU ({parts}): shard it over more workers "
                "(--resources.learner_strategy fsdp, more learner_workers), train adapters "
                "(--learner.lora.rank 64), turn on --learner.gradient_checkpointing, or halve "
                "--learner.micro_batch_tokens"
            )
        lines.append(line)
    log.info("\n".join(lines))
    for warning in warnings:
        log.warning(warning)
    return warnings
