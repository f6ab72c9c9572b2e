"""Exact match of any policy (a training checkpoint, an HF id or folder) on a question set,
overall and per data source: one greedy rollout per question against the retriever.

    python pipelines/eval.py --model runs/tspo/checkpoint      # the held-out synthetic questions
    python pipelines/eval.py --model Qwen/Qwen2.5-3B-Instruct --data.questions nq_test.parquet \\
        --data.corpus wiki.jsonl --encoder intfloat/e5-base-v2 --resources.num_generators 4
    ray job submit --working-dir . -- python pipelines/eval.py --model /shared/ckpt
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from ray_credit.actors.generator import GeneratorConfig
from ray_credit.pipeline.recipe import (
    DataConfig,
    ResourcesConfig,
    RunConfig,
    connect,
    load_data,
    make_generators,
    make_retriever,
)


@dataclass(frozen=True)
class EvalRun:
    model: str = "smollm2-135m"
    """A checkpoint folder (runs/NAME/checkpoint), an HF id or folder, or an embedded name."""
    encoder: str = "minilm"
    """Retriever encoder: 'minilm', 'e5' or an HF id / folder."""
    retriever_url: str | None = None
    """An existing `/retrieve` server to search instead of building an index here."""
    split: str = "heldout"
    """'heldout' (the questions a training run with the same data settings holds out) or 'all'."""
    output: str | None = None
    """Write the results here as JSON (None: print only)."""
    data: DataConfig = field(default_factory=DataConfig)
    generator: GeneratorConfig = field(
        default_factory=lambda: replace(RunConfig().generator, temperature=0.0, group_size=1)
    )
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    timeout_s: float = 3600.0
    """Longest wait for one generator's share of the questions."""
    seed: int = 0
    """The training run's pipeline.seed (it decides which questions are held out)."""

    def __post_init__(self) -> None:
        if self.split not in ("heldout", "all"):
            raise ValueError(f"split must be heldout or all, got {self.split!r}")


def resolve_model(path: str) -> str:
    """A training checkpoint holds the policy under learner/model."""
    for candidate in (Path(path) / "learner" / "model", Path(path) / "model"):
        if (candidate / "config.json").is_file():
            return str(candidate)
    return path


def main(argv=None) -> dict:
    from ray_credit.config import parse_config

    cfg = parse_config(EvalRun, argv, description=__doc__)
    run = RunConfig(data=cfg.data, resources=cfg.resources)
    run = replace(run, pipeline=replace(run.pipeline, seed=cfg.seed))
    ray = connect(run)
    corpus, train_q, eval_q = load_data(run)
    questions = eval_q if cfg.split == "heldout" else train_q + eval_q
    model = resolve_model(cfg.model)
    retriever = make_retriever(corpus, cfg.encoder, cfg.retriever_url, cfg.resources)
    generators = make_generators(model, retriever, cfg.generator, cfg.resources, prefix="eval")
    shares = np.array_split(np.arange(len(questions)), len(generators))
    refs = [
        g.generate.remote([questions[i] for i in share])
        for g, share in zip(generators, shares, strict=True)
        if len(share)
    ]
    per_source: dict[str, list[float]] = {}
    answered = 0.0
    for batch in ray.get(refs, timeout=cfg.timeout_s):
        reward = batch.traj_values("outcome_reward")
        answered += batch.metrics.get("gen/answered", 0.0)
        for source, r in zip(batch.column("data_source").to_pylist(), reward, strict=True):
            per_source.setdefault(source or "unknown", []).append(float(r >= 1.0))
    every = [x for v in per_source.values() for x in v]
    result = {
        "model": model,
        "split": cfg.split,
        "questions": len(every),
        "em": float(np.mean(every)),
        "answered": answered / max(len(every), 1),
        "em_by_source": {k: float(np.mean(v)) for k, v in sorted(per_source.items())},
        "count_by_source": {k: len(v) for k, v in sorted(per_source.items())},
        "config": asdict(cfg),
    }
    print(f"{'data source':<24} {'n':>6} {'EM':>7}")
    for source, em in result["em_by_source"].items():
        print(f"{source:<24} {result['count_by_source'][source]:>6} {em:>7.3f}")
    print(f"{'all':<24} {result['questions']:>6} {result['em']:>7.3f}")
    if cfg.output:
        Path(cfg.output).write_text(json.dumps(result, indent=2))
        print(f"wrote {cfg.output}")
    return result


if __name__ == "__main__":
    main()
