"""A run's outputs: where they go, metrics.jsonl, a progress line per step, wandb,
summary.json and the plot.

A run writes under ``output_dir/name`` on the driver (:class:`RunOutputs`): its summary,
metrics and plot, and wandb's run. Its checkpoints go to ``storage_path/name`` (default:
the same folder), which every node must see, with a copy of those outputs after every
step, so the storage folder holds the whole run and a resume on another head finds its
history there.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ray_credit.log import log
from ray_credit.storage import StoragePath

__all__ = [
    "Logger",
    "RunOutputs",
    "kept_evaluations",
    "plot",
    "read_metrics",
    "run_storage",
    "smooth",
    "sync_outputs",
]


class RunOutputs:
    """The folders of one run and what it has written so far (see the module docstring).

    Made before Ray starts, so a storage location it cannot write is refused then.
    :meth:`resume` brings back the history of the run a checkpoint continues, :meth:`open`
    starts the logger and the summary (keeping the first start's evaluations before
    training when their settings are unchanged), :meth:`save` writes the summary and
    copies the outputs to storage, :meth:`close` adds the plot.
    """

    def __init__(self, cfg: Any):
        self.out = Path(cfg.output_dir).resolve() / cfg.name
        self.out.mkdir(parents=True, exist_ok=True)
        self.storage = run_storage(cfg, self.out)
        self.previous: dict = {}
        self.summary: dict = {}
        self.logger: Logger | None = None

    @property
    def shared(self) -> Path:
        """A folder every node sees where the storage is a shared filesystem (else the
        driver's): where the warm-started policy goes."""
        return self.storage.local_path or self.out

    def resume(self, checkpoint: str | None) -> int | None:
        """The step the checkpoint was saved at (None for a new run), with the history of
        the run it continues brought back (from storage, on a new head node)."""
        if checkpoint is None:
            return None
        from ray_credit.pipeline.checkpointing import checkpoint_state

        sync_outputs(self.out, self.storage, fetch=True)
        self.previous = previous_summary(self.out)
        return int(checkpoint_state(checkpoint)["step"])

    def open(self, cfg: Any, run_config: dict, estimator: str, plan: Any, step: int | None):
        """The logger (metrics.jsonl, wandb) and the summary, which begins with the run's
        settings and every start of it so far; returns the summary."""
        previous = self.previous
        self.logger = Logger(cfg, self.out, resumed_step=step, wandb_id=previous.get("wandb_id"))
        run = self.logger.run
        self.summary = {
            "config": run_config,
            "estimator": estimator,
            "departures": list(plan.departures),
            "output_dir": str(self.out),
            "wandb_id": run.id if run is not None else None,
            # every start of this run: its own config is "config"; a resume keeps the
            # evaluations and history of the starts before it
            "starts": [*previous.get("starts", []), {"resumed_from": cfg.resume,
                                                       "step": step or 0}],
        }  # fmt: skip
        if previous:
            self.summary.update(kept_evaluations(previous, run_config))
        return self.summary

    def step(self, metrics: dict[str, float], total: int) -> None:
        """One step's metrics logged, and the outputs copied to storage."""
        self.logger.step(metrics, total)
        sync_outputs(self.out, self.storage)

    def save(self) -> None:
        """summary.json written (whole), and the outputs copied to storage."""
        write_summary(self.out, self.summary)
        sync_outputs(self.out, self.storage)

    def close(self) -> None:
        """The summary, the plot, wandb's run finished, all copied to storage."""
        write_summary(self.out, self.summary)
        plot(self.logger.rows, self.summary, self.out / "plot.png")
        self.logger.finish()
        sync_outputs(self.out, self.storage)


def _shown(row: dict, key: str, spec: str) -> str:
    """``row[key]`` formatted, or "-" where the step did not measure it (an update whose
    gradient was exactly zero passes no token through the model)."""
    return format(row[key], spec) if key in row else "-"


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
        # the loss's KL to the reference, when it has one; approx_kl is another quantity
        # (the sampler's logprobs against the policy's during the update)
        self.kl_ref = cfg.learner.kl_coef > 0
        wb = cfg.wandb
        if wb.mode != "disabled":
            try:
                import wandb
            except ImportError as err:
                raise ImportError(
                    "wandb logging needs `pip install ray-credit[pipeline]` (or pass --wandb disabled)"
                ) from err
            self.run = wandb.init(
                project=wb.project,
                entity=wb.entity,
                group=wb.group,
                tags=list(wb.tags) or None,
                name=cfg.name,
                dir=str(out),
                mode=wb.mode,
                config=asdict(cfg),
                reinit="finish_previous",  # a second run in one process (the study)
                id=wandb_id,
                resume="allow" if wandb_id else None,
                settings=wandb.Settings(silent=True),  # its banner is ~8 lines; ours is one
            )
            where = self.run.settings.sync_dir
            log.info(
                f"wandb: {wb.mode} run {self.run.id} of project {wb.project} in {where}"
                + (f" (upload it with `wandb sync {where}`)" if wb.mode == "offline" else "")
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
            f"EM {row.get('train/em', 0):.3f}  "
            f"all-wrong {row.get('train/groups_all_wrong', 0):.0%} of groups, "
            f"zero-adv {row.get('train/groups_zero_advantage', 0):.0%}  "
            f"loss {row.get('learner/loss', 0):+.4f}  "
            + (f"kl_ref {_shown(row, 'learner/kl', '.2e')}  " if self.kl_ref else "")
            + f"approx_kl {_shown(row, 'learner/approx_kl', '+.2e')}  "
            f"stale≤{int(row.get('staleness/max', 0))}  "
            f"gen {row.get('gen/tokens_per_s', 0):.0f} tok/s  step {row.get('time/step_s', 0):.0f}s  "
            + (
                f"mem {row['memory/node_used_gb']:.1f}/{row['memory/node_total_gb']:.0f} GB  "
                if "memory/node_used_gb" in row
                else ""
            )
            + f"[{elapsed / 60:.1f} min]",
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
    before = summary.get("eval_before") or {}
    evals = [(before.get("step", 0), before), (summary.get("steps", 0), summary.get("eval_after"))]
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


# --------------------------------------------------------------------------- storage
def run_storage(cfg: Any, out: Path) -> StoragePath:
    """Where the run's checkpoints go: ``storage_path/name`` (made here, so that a location
    it cannot write is refused before Ray starts), else ``out``."""
    from ray_credit.config import InputError

    if cfg.storage_path is None:
        return StoragePath(out)
    try:
        run_dir = StoragePath(cfg.storage_path) / cfg.name
        run_dir.mkdir()
    except (ValueError, OSError) as err:
        raise InputError(
            f"storage_path={cfg.storage_path!r}: cannot write there ({err}); give a folder "
            "every node sees or a URI such as s3://bucket/runs (credentials from the "
            "environment, as pyarrow finds them)"
        ) from None
    return run_dir


_OUTPUTS = ("summary.json", "metrics.jsonl", "plot.png")


def sync_outputs(out: Path, run_dir: StoragePath, *, fetch: bool = False) -> None:
    """The driver's outputs in ``out`` copied to the run's storage folder, so that it holds
    the whole run (nothing to do when they are one folder); ``fetch``: the other way,
    each one missing here (a resume on another machine keeps the run's history)."""
    here = StoragePath(out)
    if here == run_dir:
        return
    for name in _OUTPUTS:
        source, target = (run_dir / name, here / name) if fetch else (here / name, run_dir / name)
        if source.is_file() and not (fetch and target.exists()):
            target.write_bytes(source.read_bytes())


def write_summary(out: Path, summary: dict) -> None:
    """``summary.json``, replaced whole (a reader never sees half of it)."""
    partial = out / "summary.json.partial"
    partial.write_text(json.dumps(summary, indent=2, default=str))
    partial.replace(out / "summary.json")


def previous_summary(out: Path) -> dict:
    """What the run being resumed wrote to its ``summary.json`` so far ({} if nothing)."""
    path = out / "summary.json"
    try:
        previous = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        log.warning(f"note: {path} is not readable ({err}); the resumed run starts a new one")
        return {}
    return previous if isinstance(previous, dict) else {}


_EVALUATION_SETTINGS = ("model", "data", "generator", "retriever", "eval", "warm_start")


def kept_evaluations(previous: dict, run_config: dict) -> dict:
    """The evaluations before training (and before the warm-start) of the run a resume
    continues, kept when what decides them is unchanged (the policy it started from, the
    data, the generator, retriever, evaluation and warm-start settings): its paired change
    is then measured from the run's true start, not from where it was resumed."""
    config = previous.get("config", {})
    # compared as summary.json holds them: a tuple read back from it is a list
    now = json.loads(json.dumps(run_config, default=str))
    changed = [key for key in _EVALUATION_SETTINGS if config.get(key) != now.get(key)]
    if changed:
        log.info(f"note: the resumed run changes {', '.join(changed)}: its evaluation before "
              "training is not the first run's, and is made again")  # fmt: skip
        return {}
    keys = ("eval_before", "eval_base", "warm_start")
    return {key: previous[key] for key in keys if key in previous}
