"""A run's outputs: metrics.jsonl, a progress line per step, wandb, and the plot."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ray_credit.log import log

__all__ = ["Logger", "plot", "read_metrics", "smooth"]


class Logger:
    """metrics.jsonl, a progress line per step, and wandb (offline by default).

    A new run starts ``metrics.jsonl`` afresh. A resumed run (``resumed_step``: the step
    its checkpoint was saved at) keeps the rows of the steps up to it, drops the rows the
    interrupted run logged after it (those steps are trained again), and appends; ``rows``
    then hold the whole history, for the plot. ``wandb_id``: the wandb run to continue.
    """

    def __init__(
        self, cfg: Any, out: Path, *, resumed_step: int | None = None, wandb_id: str | None = None
    ):
        path = out / "metrics.jsonl"
        self.rows: list[dict] = []
        if resumed_step is not None and path.is_file():
            self.rows = [r for r in read_metrics(path) if r["pipeline/step"] <= resumed_step]
            partial = path.with_suffix(".jsonl.partial")
            partial.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
            partial.replace(path)
        self.file = path.open("a" if resumed_step is not None else "w")
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
                reinit="finish_previous",  # a second run in one process (the study)
                id=wandb_id,
                resume="allow" if wandb_id else None,
                settings=wandb.Settings(silent=True),  # its banner is ~8 lines; ours is one
            )
            where = self.run.settings.sync_dir
            log.info(
                f"wandb: {cfg.wandb} run {self.run.id} in {where}"
                + (f" (upload it with `wandb sync {where}`)" if cfg.wandb == "offline" else "")
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
        log.info(
            f"step {int(row['pipeline/step'])}/{total}  reward {row.get('train/reward_mean', 0):.3f}  "
            f"EM {row.get('train/em', 0):.3f}  loss {row.get('learner/loss', 0):+.4f}  "
            f"kl {row.get('learner/approx_kl', 0):.2e}  stale≤{int(row.get('staleness/max', 0))}  "
            f"gen {row.get('gen/tokens_per_s', 0):.0f} tok/s  step {row.get('time/step_s', 0):.0f}s  "
            f"[{elapsed / 60:.1f} min]",
        )

    def finish(self) -> None:
        self.file.close()
        if self.run is not None:
            self.run.finish()


def read_metrics(path: Path) -> list[dict]:
    """The step rows of a ``metrics.jsonl``; a last line cut off mid-write (a killed run)
    is left out, any other unreadable line named."""
    rows, lines = [], path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # the line a killed run was writing
                log.info(f"note: {path}:{number} was cut off mid-write; left out")
                continue
            raise ValueError(f"{path}:{number}: not a JSON metrics row") from None
        if not isinstance(row, dict) or "pipeline/step" not in row:
            raise ValueError(f"{path}:{number}: not a step's metrics (no pipeline/step)")
        rows.append(row)
    return rows


def plot(rows: list[dict], summary: dict, path: Path) -> None:
    """Training reward per step (points) with a smoothed line, training EM, and held-out
    EM before and after training with its 95 % interval (Wilson) as error bars; the
    title carries the paired change when both evaluations ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["pipeline/step"] for r in rows]
    reward = [r.get("train/reward_mean", 0.0) for r in rows]
    if rows:
        ax.plot(steps, reward, "o", color="C0", alpha=0.35, label="train reward")
        ax.plot(steps, smooth(reward), color="C0", label="train reward (smoothed)")
        ax.plot(steps, [r.get("train/em", 0.0) for r in rows], ".", color="C1", alpha=0.5,
                label="train EM")  # fmt: skip
    evals = [(0, summary.get("eval_before")), (summary.get("steps", 0), summary.get("eval_after"))]
    _eval_points(ax, [(s, e) for s, e in evals if e], "s--", "C2", "held-out EM (95% CI)")
    sampled = [(s, e["sampled"]) for s, e in evals if e and "sampled" in e]
    if sampled:
        _eval_points(ax, sampled, "D:", "C4",
                     f"held-out sampled EM ({sampled[0][1]['samples']} per question)")  # fmt: skip
    if summary.get("eval_base"):
        _eval_points(ax, [(0, summary["eval_base"])], "v", "C3",
                     "held-out EM before the warm-start")  # fmt: skip
    title = summary["config"]["name"]
    change = summary.get("eval_change", {}).get("all")
    if change:
        title += (
            f"  |  held-out EM change {change['diff']:+.3f} "
            f"[{change['low']:+.3f}, {change['high']:+.3f}], n={change['n']}"
        )
    ax.set_xlabel("step")
    ax.set_ylabel("reward / exact match")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _eval_points(ax: Any, points: list, fmt: str, color: str, label: str) -> None:
    """Held-out EM at its steps, with its 95 % interval as error bars."""
    if not points:
        return
    bars = [
        # max(0, .): float rounding at EM 0 or 1, where an end meets the point
        (max(0.0, e["em"] - e["em_interval"][0]), max(0.0, e["em_interval"][1] - e["em"]))
        if e.get("em_interval")
        else (0.0, 0.0)
        for _, e in points
    ]
    ax.errorbar([s for s, _ in points], [e["em"] for _, e in points],
                yerr=list(zip(*bars, strict=True)), fmt=fmt, color=color, capsize=4,
                label=label)  # fmt: skip


def smooth(values: list[float], weight: float = 0.6) -> list[float]:
    """Exponential moving average, debiased at the start (as TensorBoard's smoothing)."""
    if not 0 <= weight < 1:
        raise ValueError(f"weight must be in [0, 1), got {weight}")
    out, last, norm = [], 0.0, 0.0
    for value in values:
        last = weight * last + (1 - weight) * value
        norm = weight * norm + (1 - weight)
        out.append(last / norm)
    return out
