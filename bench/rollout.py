"""Rollout throughput of the generator on this machine: SmolLM2-135M against a MiniLM index
over the synthetic world, in one run.

    python bench/rollout.py                          # 8 questions x G=5, up to 3 turns
    python bench/rollout.py --questions 16 --max-new-tokens 96

Runs the same rollout (same model, questions and seed) twice in one process: with KV
reuse between turns off (every turn re-encodes its whole context) and on (the default),
and reports the speedup. For each: generated tokens/s (sampled tokens only: prompts and
observations are fed, not generated), trajectories/s, the share of time spent in
retrieval, encoded and reused prompt tokens, and the rollout's own counters (searches,
invalid and truncated turns, answers, EM). Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ray_credit.actors.generator import Generator, GeneratorConfig  # noqa: E402
from ray_credit.actors.retriever import Retriever  # noqa: E402
from ray_credit.data import WorldConfig, make_world  # noqa: E402
from ray_credit.models import load_model  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=5)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-reuse-gb", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "rollout.json")
    args = parser.parse_args()

    world = make_world(WorldConfig(seed=args.seed))
    start = time.perf_counter()
    retriever = Retriever.create(world.corpus)
    index_seconds = time.perf_counter() - start
    config = GeneratorConfig(
        group_size=args.group_size,
        max_turns=args.max_turns,
        max_new_tokens=args.max_new_tokens,
        prompt_template="search_tags_fewshot",
        response_prefix="<search>",
        seed=args.seed,
    )
    model = load_model(args.model)
    questions = world.questions[1 : 1 + args.questions]
    # warm-up (first forwards, stop-token table); each measured generator's first call
    # then samples with the same seed
    Generator(model, retriever, config).generate(world.questions[:1], group_size=1)
    runs = {}
    for label, reuse in (("reencode", 0.0), ("kv_reuse", args.kv_reuse_gb)):
        generator = Generator(model, retriever, config, kv_reuse_gb=reuse)
        start = time.perf_counter()
        batch = generator.generate(questions)
        runs[label] = _summary(batch, time.perf_counter() - start)
        print(f"--- {label} (kv_reuse_gb={reuse})")
        for key, value in runs[label].items():
            print(f"{key:>24}: {value:.3f}" if isinstance(value, float) else f"{key:>24}: {value}")
    speedup = (
        runs["kv_reuse"]["generated_tokens_per_s"] / runs["reencode"]["generated_tokens_per_s"]
    )
    print(f"{'kv reuse speedup':>24}: {speedup:.2f}x")
    result = {
        "command": " ".join(sys.argv),
        "machine": {"python": platform.python_version(), "cpus": __import__("os").cpu_count()},
        "model": args.model,
        "corpus_docs": len(world.corpus),
        "index_build_seconds": index_seconds,
        "runs": runs,
        "kv_reuse_speedup": speedup,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


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
