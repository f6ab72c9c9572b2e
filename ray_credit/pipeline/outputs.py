"""A run's outputs: metrics.jsonl, a progress line per step, wandb, and the plot."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

__all__ = ["Logger", "plot"]


class Logger:
    """metrics.jsonl, a progress line per step, and wandb (offline by default)."""

    def __init__(self, cfg: Any, out: Path):
        self.rows: list[dict] = []
        self.file = (out / "metrics.jsonl").open("a")
        self.run = None
        self.started = time.perf_counter()
        if cfg.wandb != "disabled":
            try:
                import wandb
            except ImportError as err:
                raise ImportError(
                    "wandb logging needs `pip install ray-credit[pipeline]` (or pass --wandb disabled)"
                ) from err
            self.run = wandb.init(
                project="ray_credit",
                name=cfg.name,
                dir=str(out),
                mode=cfg.wandb,
                config=asdict(cfg),
                reinit=True,
            )

    def log(self, metrics: dict, step: int) -> None:
        if self.run is not None:
            self.run.log(metrics, step=step)

    def step(self, metrics: dict, total: int) -> None:
        row = {k: float(v) for k, v in metrics.items()}
        self.rows.append(row)
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        self.log(row, step=int(row["pipeline/step"]))
        elapsed = time.perf_counter() - self.started
        print(
            f"step {int(row['pipeline/step'])}/{total}  reward {row.get('train/reward_mean', 0):.3f}  "
            f"EM {row.get('train/em', 0):.3f}  loss {row.get('learner/loss', 0):+.4f}  "
            f"kl {row.get('learner/approx_kl', 0):.2e}  stale≤{int(row.get('staleness/max', 0))}  "
            f"gen {row.get('gen/tokens_per_s', 0):.0f} tok/s  step {row.get('time/step_s', 0):.0f}s  "
            f"[{elapsed / 60:.1f} min]",
            flush=True,
        )

    def finish(self) -> None:
        self.file.close()
        if self.run is not None:
            self.run.finish()


def plot(rows: list[dict], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["pipeline/step"] for r in rows]
    ax.plot(steps, [r.get("train/reward_mean", 0) for r in rows], marker="o", label="train reward")
    ax.plot(steps, [r.get("train/em", 0) for r in rows], marker=".", label="train EM")
    evals = [(0, summary.get("eval_before")), (summary.get("steps", 0), summary.get("eval_after"))]
    points = [(s, e["em"]) for s, e in evals if e]
    if points:
        ax.plot(*zip(*points, strict=True), marker="s", linestyle="--", label="held-out EM")
    ax.set_xlabel("step")
    ax.set_ylabel("reward / exact match")
    ax.set_title(summary["config"]["name"])
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
