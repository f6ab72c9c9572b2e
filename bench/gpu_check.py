"""The GPU code paths, checked and timed on one CUDA machine in one command (about 5
minutes on one H100), one table at the end:

    python bench/gpu_check.py                 # every check; JSON in bench/results/gpu_check.json
    python bench/gpu_check.py --only faiss,learner
    python bench/gpu_check.py --dry-run       # everything up to the first CUDA call (CPU)

* ``transformers``: the transformers generator on CUDA (float32) rolls out SmolLM2 over
  the synthetic world, searching it by word overlap (no encoder, no faiss: the generator
  is what is checked); its behaviour log-probs against a teacher-forced float32 forward
  of the same weights, then a weight update (in place: the parameters' storage stays
  where it was; seconds) and the same comparison on the updated weights;
* ``slices``: one slice of wiki-18's flat e5 index as ``resources.retriever_gpu_share``
  holds it over 8 GPUs (2.63 M x 768 unit vectors, random, in float16): searches of the
  retriever's largest batch (256 queries, top 3), their queries/s, whether each query
  finds the row it was made from, the top 3 against float32's, and the GPU memory a
  search takes beyond the slice against the memory plan's allowance;
* ``vllm``: vLLM's engine on CUDA (float32) rolls out SmolLM2 over the synthetic world;
  its behaviour log-probs against a teacher-forced float32 forward of the same weights
  (max |difference|), then a weight update in place (seconds) and the same comparison on
  the updated weights;
* ``raw``: the generator's tokens/s against vLLM's own ``LLM.generate`` on the same
  prompts, sampling settings and engine (one turn each, best of 3), as a ratio;
* ``learner``: one update of SmolLM2 in bf16 autocast by a one-worker learner group, DDP
  and FSDP2 (seconds, trained tokens/s, loss);
* ``faiss``: faiss-gpu against faiss-cpu on one flat index (the same top hits, queries/s
  each);
* ``pipeline``: ``pipelines/tspo.py`` for 3 steps on one GPU (SmolLM2 learner and a vLLM
  generator sharing it), through its checkpoint;
* ``scale``: the learner itself (no Ray, one process, FSDP2 or DDP over a process group of
  one) at the sizes a Search-R1 run trains: SmolLM2-135M's, Qwen2.5-3B's and
  Qwen2.5-7B's (LoRA) architectures with random weights (no download: the step's cost
  and memory do not depend on the weights' values), float32 master weights under bf16
  autocast, a batch of Search-R1-sized trajectories (80 rows, a 256-token prompt and up
  to 4 turns of 400 tokens) with random non-zero advantages; per case the update's
  seconds, trained tokens/s, the GPU's peak memory (allocated and reserved; per phase:
  building, the reference's log-probs, the passes, AdamW's step) and what
  :mod:`ray_credit.pipeline.memory` estimates for the same settings (their ratio).

A check that fails is reported as failed with its error and the others still run; the
exit status says whether all passed. ``--dry-run`` builds every check's settings and
imports what each needs, and stops before the first CUDA call (CI runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import weakref
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "bench"))

from ray_credit.actors.generator import GeneratorConfig  # noqa: E402
from ray_credit.actors.learner import LearnerConfig  # noqa: E402
from ray_credit.actors.sampling import VLLMConfig  # noqa: E402
from ray_credit.data import WorldConfig, make_world  # noqa: E402
from ray_credit.pipeline.memory import SLICE_BATCH  # noqa: E402

CHECKS = ("transformers", "slices", "vllm", "raw", "learner", "faiss", "pipeline", "scale")
NEEDS = {"transformers": ["torch", "transformers", "pyarrow"], "slices": ["torch"],
         "vllm": ["vllm"], "raw": ["vllm"], "learner": ["torch", "ray"], "faiss": ["faiss"],
         "pipeline": ["vllm", "ray"], "scale": ["torch", "transformers"]}  # fmt: skip
MODEL = "smollm2-135m"

# The architectures of the scale check, from their published config.json files (random
# weights are built from these; nothing is downloaded).
ARCHITECTURES = {
    "smollm2-135m": {
        "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "tie_word_embeddings": True, "hidden_act": "silu",
    },
    "qwen2.5-3b": {
        "model_type": "qwen2", "hidden_size": 2048, "intermediate_size": 11008,
        "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 2,
        "vocab_size": 151936, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": True, "hidden_act": "silu",
    },
    "qwen2.5-7b": {
        "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "vocab_size": 152064, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "hidden_act": "silu",
    },
}  # fmt: skip
# (architecture, strategy, LearnerConfig settings beyond the shared ones), in order: a
# case that runs out of memory is reported and the next still runs.
SCALE_CASES = (
    ("smollm2-135m", "ddp", {"micro_batch_tokens": 8192}),
    ("smollm2-135m", "fsdp", {"micro_batch_tokens": 8192}),
    ("qwen2.5-3b", "fsdp", {"micro_batch_tokens": 4096, "gradient_checkpointing": True}),
    ("qwen2.5-3b", "fsdp", {"micro_batch_tokens": 4096, "gradient_checkpointing": True,
                            "kl_coef": 0.001}),
    ("qwen2.5-3b", "ddp", {"micro_batch_tokens": 4096, "gradient_checkpointing": True,
                           "kl_coef": 0.001}),
    ("qwen2.5-7b", "fsdp", {"micro_batch_tokens": 4096, "gradient_checkpointing": True,
                            "kl_coef": 0.001, "dtype": "bfloat16", "lora": {"rank": 64}}),
)  # fmt: skip


def settings(args: argparse.Namespace) -> dict:
    """Every check's settings, built before anything touches CUDA."""
    gen = GeneratorConfig(
        backend="vllm", dtype="float32", group_size=4, max_turns=2, max_new_tokens=48,
        temperature=1.0, prompt_template="search_tags_fewshot", response_prefix="<search>",
        vllm=VLLMConfig(gpu_memory_utilization=0.3), seed=1,
    )  # fmt: skip
    return {
        "generator": gen,
        "raw": replace(gen, max_turns=1, group_size=8, max_new_tokens=args.raw_tokens),
        "learner": LearnerConfig(lr=1e-5, autocast="bfloat16", micro_batch_tokens=8192),
        "faiss": {"docs": args.faiss_docs, "dim": 384, "queries": 1024, "k": 3},
        "slices": {
            "rows": args.slice_rows,
            "dim": 768,
            "queries": SLICE_BATCH,
            "k": 3,
            "searches": 10,
        },
        "pipeline": [
            sys.executable,
            str(ROOT / "pipelines" / "tspo.py"),
            "--name",
            "gpu-check",
            "--model",
            MODEL,
            "--pipeline.steps",
            "3",
            "--pipeline.groups_per_step",
            "4",
            "--pipeline.checkpoint_every",
            "3",
            "--data.eval_questions",
            "8",
            "--warm_start.questions",
            "24",
            "--warm_start.epochs",
            "1",
            "--wandb",
            "disabled",
            "--generator.backend",
            "vllm",
            "--generator.dtype",
            "bfloat16",
            "--generator.vllm.gpu_memory_utilization",
            "0.3",
            "--resources.use_gpu",
            "true",
            "--resources.learner_gpus",
            "0.5",
            "--resources.generator_gpus",
            "0.4",
            "--resources.local_gpus",
            "1",
        ],  # fmt: skip
    }


class _OverlapRetriever:
    """The world's documents ranked by the words they share with the query: a retriever
    with neither an encoder nor faiss, for checking a generator where they are absent."""

    def __init__(self, docs: list[dict]) -> None:
        from ray_credit.actors.corpus import Corpus

        self.corpus = Corpus(docs)
        self.words = [set(d["contents"].lower().split()) for d in docs]

    def search(self, queries: list[str], topk: int) -> list[list[dict]]:
        out = []
        for query in queries:
            words = set(query.lower().split())
            scores = [len(words & doc) for doc in self.words]
            rows = sorted(range(len(scores)), key=lambda r: (-scores[r], r))[:topk]
            out.append(self.corpus.hits(rows, [float(scores[r]) for r in rows]))
        return out


def check_transformers(cfg: dict, out: dict) -> None:
    import torch

    from ray_credit.actors.generator import Generator
    from ray_credit.models import load_model
    from ray_credit.testing import max_logprob_gap

    world = make_world(WorldConfig(seed=0))
    gen = replace(cfg["generator"], backend="transformers")
    t0 = time.perf_counter()
    generator = Generator(MODEL, _OverlapRetriever(world.corpus), gen, device="cuda")
    out["load_s"] = time.perf_counter() - t0
    torch.backends.cuda.matmul.allow_tf32 = False
    model, _ = load_model(MODEL, device="cuda")
    questions = world.questions[:4]
    batch = generator.generate(questions)
    out["trajectories"] = len(batch)
    out["logprob_gap"] = max_logprob_gap(model, batch)
    with torch.no_grad():  # new weights: every parameter moved a little
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    held = generator.sampler.model
    where = {name: p.data_ptr() for name, p in held.named_parameters()}
    t0 = time.perf_counter()
    generator.update_weights(1, state)
    out["weight_update_s"] = time.perf_counter() - t0
    moved = [n for n, p in held.named_parameters() if p.data_ptr() != where[n]]
    out["in_place"] = generator.sampler.model is held and not moved
    out["logprob_gap_after_update"] = max_logprob_gap(model, generator.generate(questions))
    out["ok"] = (out["in_place"] and out["logprob_gap"] < 2e-3
                 and out["logprob_gap_after_update"] < 2e-3)  # fmt: skip


def check_slices(cfg: dict, out: dict) -> None:
    import torch

    from ray_credit.actors.flat_slices import FlatSlice
    from ray_credit.pipeline.memory import GB

    spec = cfg["slices"]
    rows, dim, n, k = spec["rows"], spec["dim"], spec["queries"], spec["k"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    vectors = torch.empty((rows, dim), dtype=torch.float16, device="cuda")
    for start in range(0, rows, 1 << 18):  # unit rows, made in float32 a block at a time
        block = torch.randn((min(1 << 18, rows - start), dim), device="cuda", generator=gen)
        vectors[start : start + len(block)] = torch.nn.functional.normalize(block, dim=1)
    half = FlatSlice(vectors, lo=0)
    picked = torch.randint(0, rows, (spec["searches"], n), device="cuda", generator=gen)
    noise = torch.randn((spec["searches"], n, dim), device="cuda", generator=gen) * 0.02
    queries = [(vectors[p].float() + e).cpu().numpy() for p, e in zip(picked, noise, strict=True)]
    half.search(queries[0], k)  # warm-up: kernels, cuBLAS's workspace
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    found = [half.search(q, k)[1] for q in queries]
    seconds = time.perf_counter() - t0
    out["slice_gb"] = half.nbytes / GB
    out["search_workspace_gb"] = (torch.cuda.max_memory_allocated() - base) / GB
    out["plan_workspace_gb"] = FlatSlice.workspace_bytes(n, k, dim=dim, dtype=torch.float16) / GB
    out["queries_per_s"] = spec["searches"] * n / seconds
    out["ms_per_search"] = 1000 * seconds / spec["searches"]
    truth = picked.cpu().numpy()
    out["top1_is_the_query_row"] = float(
        sum((f[:, 0] == t).mean() for f, t in zip(found, truth, strict=True)) / len(found)
    )
    # float16 against float32 on the first quarter of the rows (a float32 copy fits beside)
    quarter = rows // 4
    exact = FlatSlice(vectors[:quarter].float(), lo=0)
    rounded = FlatSlice(vectors[:quarter], lo=0)
    same = [(exact.search(q, k)[1] == rounded.search(q, k)[1]).all(axis=1).mean()
            for q in queries[:2]]  # fmt: skip
    out["same_top3_as_float32"] = float(sum(same) / len(same))
    out["ok"] = (out["top1_is_the_query_row"] > 0.99 and out["same_top3_as_float32"] > 0.9
                 and out["search_workspace_gb"] <= out["plan_workspace_gb"])  # fmt: skip


def check_vllm(cfg: dict, out: dict) -> None:
    import torch

    from ray_credit.actors.generator import Generator
    from ray_credit.actors.retriever import Retriever
    from ray_credit.models import load_model
    from ray_credit.testing import max_logprob_gap

    world = make_world(WorldConfig(seed=0))
    retriever = Retriever.create(world.corpus)
    t0 = time.perf_counter()
    generator = Generator(MODEL, retriever, cfg["generator"])
    out["engine_start_s"] = time.perf_counter() - t0
    torch.backends.cuda.matmul.allow_tf32 = False
    model, _ = load_model(MODEL, device="cuda")

    questions = world.questions[:4]
    out["logprob_gap"] = max_logprob_gap(model, generator.generate(questions))
    with torch.no_grad():  # new weights: every parameter moved a little
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    t0 = time.perf_counter()
    generator.update_weights(1, state)
    out["weight_update_s"] = time.perf_counter() - t0
    out["logprob_gap_after_update"] = max_logprob_gap(model, generator.generate(questions))
    out["ok"] = out["logprob_gap"] < 2e-3 and out["logprob_gap_after_update"] < 2e-3


def check_raw(cfg: dict, out: dict) -> None:
    from rollout import generator_vs_raw  # bench/rollout.py

    from ray_credit.actors.generator import Generator
    from ray_credit.actors.retriever import Retriever

    world = make_world(WorldConfig(seed=0))
    generator = Generator(MODEL, Retriever.create(world.corpus), cfg["raw"])
    out.update(generator_vs_raw(generator, world.questions[:32]))
    out["ok"] = out["ratio"] > 0


def check_learner(cfg: dict, out: dict) -> None:
    import ray
    import torch

    from ray_credit.actors.generator import Generator
    from ray_credit.actors.learner_group import LearnerGroup
    from ray_credit.actors.retriever import Retriever
    from ray_credit.estimators import get_estimator

    world = make_world(WorldConfig(seed=0))
    gen = replace(cfg["generator"], backend="transformers", dtype="bfloat16")
    batch = Generator(MODEL, Retriever.create(world.corpus), gen).generate(world.questions[:16])
    batch = get_estimator("grpo")(batch)
    tokens = int(sum(len(r["input_ids"]) for r in batch.to_records()))
    ray.init(num_gpus=torch.cuda.device_count(), include_dashboard=False, ignore_reinit_error=True)
    for strategy in ("ddp", "fsdp"):
        group = LearnerGroup(MODEL, cfg["learner"], num_workers=1, use_gpu=True,
                             resources_per_worker={"CPU": 1, "GPU": 1}, strategy=strategy)  # fmt: skip
        group.train(batch)  # the first step compiles kernels and allocates the state
        t0 = time.perf_counter()
        metrics = group.train(batch)
        seconds = time.perf_counter() - t0
        out[f"{strategy}_step_s"] = seconds
        out[f"{strategy}_tokens_per_s"] = tokens / seconds
        out[f"{strategy}_loss"] = metrics.get("learner/loss")
        group.shutdown()
    ray.shutdown()
    out["ok"] = all(out.get(f"{s}_loss") is not None for s in ("ddp", "fsdp"))


def check_faiss(cfg: dict, out: dict) -> None:
    import faiss
    import numpy as np

    spec = cfg["faiss"]
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((spec["docs"], spec["dim"]), np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    queries = vectors[rng.choice(spec["docs"], spec["queries"], replace=False)] + 0.05
    cpu = faiss.IndexFlatIP(spec["dim"])
    cpu.add(vectors)
    gpu = faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), 0, cpu)
    timings = {}
    hits = {}
    for name, index in (("cpu", cpu), ("gpu", gpu)):
        index.search(queries[:8], spec["k"])  # warm-up
        t0 = time.perf_counter()
        _, hits[name] = index.search(queries, spec["k"])
        timings[name] = time.perf_counter() - t0
    out["same_top1"] = float((hits["cpu"][:, 0] == hits["gpu"][:, 0]).mean())
    out["cpu_queries_per_s"] = spec["queries"] / timings["cpu"]
    out["gpu_queries_per_s"] = spec["queries"] / timings["gpu"]
    out["gpu_over_cpu"] = timings["cpu"] / timings["gpu"]
    out["ok"] = out["same_top1"] > 0.99


def check_pipeline(cfg: dict, out: dict) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        run = subprocess.run([*cfg["pipeline"], "--output_dir", tmp], capture_output=True,
                             text=True, cwd=ROOT, timeout=420)  # fmt: skip
        out["seconds"] = time.perf_counter() - t0
        if run.returncode != 0:
            raise RuntimeError(f"tspo.py exited {run.returncode}: {run.stderr[-1500:]}")
        summary = json.loads((Path(tmp) / "gpu-check" / "summary.json").read_text())
    out["steps"] = summary["steps"]
    out["eval_before"] = summary["eval_before"]["em"]
    out["eval_after"] = summary["eval_after"]["em"]
    out["ok"] = summary["steps"] == 3


class _Phases:
    """CUDA memory over the phases of an update, in GiB: allocated when a phase starts,
    its peak (allocated and reserved) and allocated when it ends, the maximum over its
    calls. Phases nest (the optimizer's step runs inside the passes); without CUDA it
    records nothing."""

    def __init__(self, torch_module) -> None:
        self.torch = torch_module
        self.record: dict[str, dict[str, float]] = {}
        self._open: list[list[float]] = []  # per open phase: its peak so far, reserved

    def wrap(self, name: str, fn):
        def run(*args, **kwargs):
            with self(name):
                return fn(*args, **kwargs)

        return run

    @contextlib.contextmanager
    def __call__(self, name: str):
        if self.torch is None:
            yield
            return
        cuda = self.torch.cuda
        cuda.synchronize()
        if self._open:  # the enclosing phase's peak until now, before the counter resets
            self._open[-1][0] = max(self._open[-1][0], cuda.max_memory_allocated())
            self._open[-1][1] = max(self._open[-1][1], cuda.max_memory_reserved())
        start = cuda.memory_allocated()
        cuda.reset_peak_memory_stats()
        peaks = [0.0, 0.0]
        self._open.append(peaks)
        try:
            yield
        finally:
            cuda.synchronize()
            self._open.pop()
            gb = 1024**3
            now = {"start_gb": start / gb,
                   "peak_gb": max(peaks[0], cuda.max_memory_allocated()) / gb,
                   "reserved_gb": max(peaks[1], cuda.max_memory_reserved()) / gb,
                   "end_gb": cuda.memory_allocated() / gb}  # fmt: skip
            seen = self.record.setdefault(name, now)
            for key, value in now.items():
                seen[key] = max(seen[key], value)


def scale_batch(rows_per_group: int = 5, groups: int = 16, seed: int = 0):
    """Search-R1-sized trajectories: a 256-token prompt, 1-4 turns of 400 tokens (half
    generated, half retrieved), random non-zero advantages on every turn."""
    import numpy as np

    from ray_credit.testing import random_batch

    batch = random_batch(seed, num_groups=groups, group_size=rows_per_group, max_turns=4,
                         singleton_frac=0.0, prompt_tokens=256, tokens_per_turn=400)  # fmt: skip
    advantages = np.random.default_rng(seed).normal(size=batch.num_turns).astype(np.float32)
    return batch.with_turn_columns({"turn_advantages": advantages})


def scale_config(settings: dict):
    """The LearnerConfig of a scale case: lr 1e-6, bf16 autocast, rows run whole."""
    from ray_credit.actors.learner import LearnerConfig
    from ray_credit.actors.lora import LoraConfig

    settings = dict(settings)
    if "lora" in settings:
        settings["lora"] = LoraConfig(**settings["lora"])
    return LearnerConfig(lr=1e-6, autocast="bfloat16", share_prefix=False, **settings)


def scale_estimate(arch: dict, strategy: str, config) -> dict:
    """ray_credit.pipeline.memory's learner row for one worker with ``config``."""
    from types import SimpleNamespace

    from ray_credit.pipeline.memory import ModelShape, estimate

    resources = SimpleNamespace(use_gpu=True, learner_workers=1, learner_strategy=strategy,
                                generator_gpus=0)  # fmt: skip
    cfg = SimpleNamespace(resources=resources, learner=config, generator=None)
    return estimate(cfg, ModelShape.from_config(arch), None)[0]


def scale_case(arch: dict, strategy: str, settings: dict, batch, device: str) -> dict:
    """One learner update of ``arch`` (random weights) on ``batch``: seconds, trained
    tokens/s, peak memory (CUDA only) and the memory estimate of the same settings. The
    caller has joined a process group (:func:`ray_credit.testing.process_group_of_one`)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ray_credit.actors.learner import Learner, TorchDistributed, TorchFSDP
    from ray_credit.testing import PadOnlyTokenizer

    config = scale_config(settings)
    cuda = device.startswith("cuda")
    phases = _Phases(torch if cuda else None)
    if cuda:
        torch.cuda.empty_cache()
    hf_config = AutoConfig.for_model(**arch)
    torch.manual_seed(0)
    with phases("init"):
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=getattr(torch, config.dtype))
        world = TorchFSDP() if strategy == "fsdp" else TorchDistributed()
        learner = Learner((model.eval(), PadOnlyTokenizer()), config, device=device, world=world)
    for method, phase in (("_logprobs_no_grad", "reference"), ("_optimizer_step", "passes"),
                          ("_clip_and_step", "optimizer")):  # fmt: skip
        setattr(learner, method, phases.wrap(phase, getattr(learner, method)))
    out: dict = {"params_b": sum(p.numel() for p in model.parameters()) / 1e9}
    try:
        learner.train(batch)  # the first update allocates AdamW's state and warms kernels
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        metrics = learner.train(batch)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        out.update(step_s=seconds, tokens=metrics["learner/tokens"],
                   tokens_per_s=metrics["learner/tokens"] / seconds,
                   loss=metrics.get("learner/loss"), grad_norm=metrics.get("learner/grad_norm"))  # fmt: skip
        if cuda:
            out["peak_allocated_gb"] = max(r["peak_gb"] for r in phases.record.values())
            out["peak_reserved_gb"] = max(r["reserved_gb"] for r in phases.record.values())
            out["phases_gb"] = {k: {f: round(v, 2) for f, v in r.items()}
                                for k, r in phases.record.items()}  # fmt: skip
    finally:
        # The phase wrappers hold the learner's bound methods: a reference cycle that kept
        # the learner (its weights, AdamW state, reference) on the GPU into the next case
        # until the garbage collector ran. Break it, and collect before the next case.
        for method in ("_logprobs_no_grad", "_optimizer_step", "_clip_and_step"):
            vars(learner).pop(method, None)
        gone = weakref.ref(learner)
        del learner, model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        out["learner_freed"] = gone() is None
    row = scale_estimate(arch, strategy, config)
    out["estimate_gb"] = row["total"]
    if "peak_reserved_gb" in out:
        out["estimate_over_peak"] = row["total"] / out["peak_reserved_gb"]
    return out


def case_name(arch: str, strategy: str, settings: dict) -> str:
    """A scale case's key in the results."""
    return f"{arch} {strategy}" + "".join(f" {k}={v}" for k, v in settings.items())


def check_scale(cfg: dict, out: dict) -> None:
    from ray_credit.testing import process_group_of_one

    batch = scale_batch()
    failed = []
    with process_group_of_one("nccl"):
        for arch, strategy, settings in SCALE_CASES:
            name = case_name(arch, strategy, settings)
            try:
                out[name] = scale_case(ARCHITECTURES[arch], strategy, settings, batch, "cuda")
            except Exception as err:  # out of memory, say: reported, the next still runs
                out[name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
                failed.append(name)
            print(f"  scale {name}: {out[name]}", flush=True)
    out["ok"] = not failed


def _figures(values: dict) -> str:
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                     for k, v in values.items())  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dry-run", action="store_true", help="stop before the first CUDA call")
    parser.add_argument("--only", default=",".join(CHECKS), help=f"some of {CHECKS}")
    parser.add_argument("--raw-tokens", type=int, default=128)
    parser.add_argument("--faiss-docs", type=int, default=1_000_000)
    parser.add_argument("--slice-rows", type=int, default=2_626_916,
                        help="rows of the slices check's slice (wiki-18's 21,015,324 over 8)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu_check.json")
    args = parser.parse_args()
    chosen = [c for c in args.only.split(",") if c]
    unknown = sorted(set(chosen) - set(CHECKS))
    if unknown:
        parser.error(f"unknown checks {unknown}; choose from {CHECKS}")
    cfg = settings(args)
    missing = {c: [m for m in NEEDS[c] if importlib.util.find_spec(m) is None] for c in chosen}
    if args.dry_run:
        print(f"gpu_check dry run: {len(chosen)} checks set up, nothing run on a GPU")
        for check in chosen:
            need = ", ".join(missing[check]) or "nothing"
            print(f"  {check:<9} settings built; missing here: {need}")
        print(f"  pipeline command: {' '.join(cfg['pipeline'][1:])}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device (--dry-run checks the setup on a CPU)")
        return 2
    card = torch.cuda.get_device_name(0)
    results: dict[str, dict] = {}
    started = time.perf_counter()
    for check in chosen:
        out: dict = {}
        t0 = time.perf_counter()
        try:
            if missing[check]:
                raise ImportError(f"needs {missing[check]} installed")
            globals()[f"check_{check}"](cfg, out)
        except Exception as err:  # reported, and the other checks still run
            out["ok"] = False
            out["error"] = f"{type(err).__name__}: {err}"
            traceback.print_exc()
        out["check_s"] = time.perf_counter() - t0
        results[check] = out
        print(f"{check}: {out}", flush=True)
    print(f"\nGPU check on {card} ({time.perf_counter() - started:.0f} s in all)")
    print(f"{'check':<9} {'ok':<5} figures")
    for check, out in results.items():
        flat = {
            k: v for k, v in out.items() if k not in ("ok", "error") and not isinstance(v, dict)
        }
        error = f"; {out['error']}" if "error" in out else ""
        print(f"{check:<9} {str(out['ok']):<5} {_figures(flat)}{error}")
        for case, figures in out.items():  # the scale check's cases, one line each
            if isinstance(figures, dict):
                print(f"{'':<15} {case}: {_figures(figures)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": " ".join(sys.argv), "card": card, "torch": torch.__version__,
        "python": platform.python_version(), "cpus": os.cpu_count(), "results": results,
    }, indent=2))  # fmt: skip
    print(f"wrote {args.out}")
    return 0 if all(out["ok"] for out in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
