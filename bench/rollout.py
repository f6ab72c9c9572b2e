"""Rollout throughput of the generator on this machine: SmolLM2-135M against a MiniLM index
over the synthetic world, in one run.

    python bench/rollout.py                          # 8 questions x G=5, up to 3 turns
    python bench/rollout.py --questions 16 --max-new-tokens 96

Reports generated tokens/s (sampled tokens only: prompts and observations are fed, not
generated), trajectories/s, the share of time spent in retrieval, and the rollout's own
counters (searches, invalid and truncated turns, answers, EM). Writes JSON.
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
    generator = Generator(args.model, retriever, config)
    generator.generate(world.questions[:1], group_size=1)  # warm-up: caches, first forward
    questions = world.questions[1 : 1 + args.questions]
    start = time.perf_counter()
    batch = generator.generate(questions)
    seconds = time.perf_counter() - start
    m = batch.metrics
    rewards = batch.traj_values("outcome_reward")
    result = {
        "command": " ".join(sys.argv),
        "machine": {"python": platform.python_version(), "cpus": __import__("os").cpu_count()},
        "model": args.model,
        "corpus_docs": len(world.corpus),
        "index_build_seconds": index_seconds,
        "trajectories": len(batch),
        "seconds": seconds,
        "generated_tokens": m["gen/generated_tokens"],
        "generated_tokens_per_s": m["gen/generated_tokens"] / seconds,
        "trajectories_per_s": len(batch) / seconds,
        "retrieval_share": m["gen/retrieval_seconds"] / seconds,
        "turns": m["gen/turns"],
        "searches": m["gen/searches"],
        "invalid_actions": m["gen/invalid_actions"],
        "truncated_turns": m["gen/truncated_turns"],
        "answered": m["gen/answered"],
        "exact_match": float(rewards.mean()),
    }
    for key, value in result.items():
        print(f"{key:>24}: {value:.3f}" if isinstance(value, float) else f"{key:>24}: {value}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
