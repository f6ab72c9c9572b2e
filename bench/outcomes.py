"""What RL sees: a policy's sampled outcomes on held-out questions, by hop type and by how
many searches each trajectory took.

    python bench/outcomes.py --model runs/tspo/warm_start           # 20 questions per type, G=8
    python bench/outcomes.py --model runs/tspo/checkpoint --questions 40 --temperature 1.0

Samples G trajectories of the first N held-out questions of each data source (the
synthetic world's 1-hop and 2-hop questions) with the main job's generator settings
(``ray_credit/configs/embedded.yaml``, or ``--config``), at the training temperature unless
told otherwise, and prints per data source and number of searches the share of the
trajectories and their exact match. A group-relative advantage tells apart only what
differs inside a group, so this table says which decisions the sampled outcomes reward
(answering after one search on a 1-hop question, say) before anything is trained.
Runs in one process (no Ray). JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="a policy folder or a run's checkpoint")
    parser.add_argument("--questions", type=int, default=20, help="per data source")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=None, help="default: the config's")
    parser.add_argument("--seed", type=int, default=0, help="the held-out split and sampling")
    parser.add_argument("--config", default=str(ROOT / "ray_credit" / "configs" / "embedded.yaml"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.questions < 1 or args.group_size < 1:
        parser.error("--questions and --group-size must be >= 1")

    from ray_credit.actors.generator import Generator
    from ray_credit.actors.retriever import Retriever
    from ray_credit.pipeline.cli import run_config_class
    from ray_credit.pipeline.configs import load_config
    from ray_credit.pipeline.questions import load_data

    resolve_model = run_config_class(ROOT / "pipelines" / "eval.py", "resolve_model")
    cls = run_config_class(ROOT / "pipelines" / "tspo.py", "TSPORun")
    cfg = load_config(cls, "tspo", ["--config", args.config])
    corpus, _, held_out = load_data(cfg.data, seed=args.seed)
    by_source: dict[str, list[dict]] = defaultdict(list)
    for question in held_out:
        by_source[question.get("data_source") or "unknown"].append(question)
    questions = [q for source in sorted(by_source) for q in by_source[source][: args.questions]]
    retriever = Retriever.create(corpus, encoder=cfg.retriever.encoder, index=cfg.retriever.index)
    sampling = replace(
        cfg.generator,
        group_size=args.group_size,
        temperature=cfg.generator.temperature if args.temperature is None else args.temperature,
        seed=args.seed,
    )
    batch = Generator(resolve_model(args.model), retriever, sampling).generate(questions)
    cells: dict[tuple[str, int], list[float]] = defaultdict(list)
    for record in batch.to_records():
        searches = sum(turn["action"] == "search" for turn in record["turns"])
        cells[record["data_source"] or "unknown", searches].append(record["outcome_reward"])
    rows = []
    for source in sorted(by_source):
        total = sum(len(v) for (s, _), v in cells.items() if s == source)
        for (s, searches), rewards in sorted(cells.items()):
            if s == source:
                em = sum(r >= 1.0 for r in rewards) / len(rewards)
                rows.append({"source": source, "searches": searches, "trajectories": len(rewards),
                             "share": len(rewards) / total, "em": em})  # fmt: skip
    print(f"{args.model}: {args.questions} held-out questions per source x G={args.group_size}, "
          f"temperature {sampling.temperature}")  # fmt: skip
    print("| source | searches | share of trajectories | EM |\n|---|---:|---:|---:|")
    for row in rows:
        print(f"| {row['source']} | {row['searches']} | {row['share']:.2f} ({row['trajectories']}) "
              f"| {row['em']:.2f} |")  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps({"model": args.model, "args": vars(args) | {"out": None},
                                        "rows": rows}, indent=2, default=str))  # fmt: skip
    return 0


if __name__ == "__main__":  # vLLM's engine spawns processes
    raise SystemExit(main())
