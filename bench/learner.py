"""Learner throughput: one policy update on search-agent trajectories, five ways.

    python bench/learner.py                       # SmolLM2-135M, 4 questions x G=8
    python bench/learner.py --model tiny-random   # seconds, for a smoke test

The batch is real: a scripted expert's rollouts of the synthetic world's questions through
the generator (the warm-start's demonstrations: prompt, turns, one retrieved document per
search), each repeated ``--group_size`` times as a GRPO group's rows share their prompt,
with random non-zero advantages on every turn. The same update is timed with

* ``float32, every position``: the vocabulary projection of every position (what the
  learner did first);
* ``float32, trained span``: the projection of every position from the first trained
  token on;
* ``bf16 autocast, trained span``: ``learner.autocast="bfloat16"`` on top;
* ``+ shared prompt``: ``learner.share_prefix`` on top: each micro-batch's common prefix
  through the model once (the three above run every row whole);
* ``+ trained positions only``: on top, only the positions a row trains on, not the
  observations between its turns (the learner as it is).

Reports padded and real tokens per second of each (median of ``--repeats`` updates after
one warm-up) and the ratios to the first, measured in one run; JSON to ``--out``.

    python bench/learner.py --questions 12 --group_size 5 --micro-batch-memory 4096,2048

instead measures, for each ``micro_batch_tokens``, the learner's peak resident memory
and its update time, each value in a fresh process (a peak is per process), with a KL
reference (IGPO's ``kl_coef`` 0.001: every trajectory then runs, and the frozen copy is
held) and bf16 autocast at temperature 0.8, as the sparse study trains.

    python bench/learner.py --questions 4 --phases 1024

gives, for the main job's learner settings (``off_policy: tis``, temperature 0.8, autocast
``auto``, no KL) at that ``micro_batch_tokens``, each update's peak resident memory in
each of its phases: the passes' forward and loss, their backward, the optimizer's step,
and the rest (the batch's preparation between them). Each is the kernel's own peak for
the phase (``VmHWM``, reset at every boundary), so a short spike is not missed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def demonstrations(model: str, count: int, group_size: int):
    from ray_credit.actors.generator import GeneratorConfig
    from ray_credit.actors.retriever import Retriever
    from ray_credit.batch import TrajectoryBatch
    from ray_credit.data import WorldConfig
    from ray_credit.models import load_tokenizer
    from ray_credit.pipeline.configs import DataConfig
    from ray_credit.pipeline.questions import load_data
    from ray_credit.warm_start import demonstrate

    corpus, train_q, _ = load_data(DataConfig(world=WorldConfig(num_entities=60)), seed=0)
    titles = {str(d["id"]): d["contents"].partition("\n")[0] for d in corpus}
    gen = GeneratorConfig(
        group_size=1, max_turns=3, max_new_tokens=32, topk=1, prompt_template="search_brief",
        response_prefix="<search>", final_turn_prefix="<answer>", max_context_tokens=2048,
    )  # fmt: skip
    batch, _ = demonstrate(
        train_q[:count], titles, load_tokenizer(model), Retriever.create(corpus), gen
    )
    records = [
        {**r, "traj_id": f"{r['traj_id']}#{g}", "group_id": f"{r['group_id']}#q{i}"}
        for i, r in enumerate(batch.to_records())
        for g in range(group_size)
    ]
    batch = TrajectoryBatch.from_records(records)
    advantages = np.random.default_rng(0).normal(size=batch.num_turns).astype(np.float32)
    return batch.with_turn_columns({"turn_advantages": advantages})


def time_updates(
    model: str, batch, *, autocast: str | None, projection: str, share: bool, repeats: int
):
    """Median seconds of an update whose vocabulary projection takes ``projection``:
    ``"every"`` position, the trained ``"span"`` whole, or the ``"trained"`` positions."""
    import torch

    import ray_credit.actors.learner as learner_module
    from ray_credit.actors.learner import Learner, LearnerConfig
    from ray_credit.models import load_model

    span, columns = learner_module.trained_span, learner_module.trained_columns
    if projection == "every":
        learner_module.trained_span = lambda mask, width: slice(0, width - 1)
    if projection in ("every", "span"):
        learner_module.trained_columns = lambda mask: torch.arange(mask.shape[1])
    try:
        config = LearnerConfig(
            lr=1e-6, autocast=autocast, micro_batch_tokens=4096, share_prefix=share
        )
        learner = Learner(load_model(model), config)
        seconds = []
        for i in range(repeats + 1):
            start = time.perf_counter()
            learner.train(batch)
            if i:  # the first update warms up allocators and kernels
                seconds.append(time.perf_counter() - start)
    finally:
        learner_module.trained_span, learner_module.trained_columns = span, columns
    return statistics.median(seconds)


def peak_memory(model: str, batch, micro_batch_tokens: int, repeats: int) -> dict:
    """One learner's peak resident memory (the process's, so run it in a fresh one) and
    median update time over ``repeats`` updates after a first."""
    from ray_credit.actors.learner import Learner, LearnerConfig
    from ray_credit.models import load_model

    config = LearnerConfig(
        lr=1e-5, kl_coef=1e-3, autocast="bfloat16", temperature=0.8,
        micro_batch_tokens=micro_batch_tokens,
    )  # fmt: skip
    learner = Learner(load_model(model), config)
    loaded = _status_gb("VmRSS")
    seconds, peaks = [], [loaded]
    for i in range(repeats + 1):
        start = time.perf_counter()
        metrics = learner.train(batch)
        if i:
            seconds.append(time.perf_counter() - start)
        # the learner reads the process's peak at the end of each update and starts a new
        # window (memory/learner_peak_gb): /proc's VmHWM read after the loop would give
        # only what came after the last update
        peaks.append(metrics["memory/learner_peak_gb"])
    return {"micro_batch_tokens": micro_batch_tokens, "seconds": statistics.median(seconds),
            "loaded_gb": loaded, "peak_gb": max(peaks),
            "after_update_gb": _status_gb("VmRSS")}  # fmt: skip


PHASES = ("forward", "backward", "optimizer step", "rest")


def phase_peaks(learner, batch) -> tuple[dict[str, float], dict]:
    """One ``learner.train(batch)``: its peak resident memory (GiB) in each of
    :data:`PHASES`, and its metrics. Each pass's forward runs from the vocabulary
    projection's call to its backward; a no-grad pass (proximal log-probs) counts as
    forward. The learner's own ``memory/learner_peak_gb`` then spans only the last phase:
    the phases' highest is the update's peak."""
    import torch

    from ray_credit.process_memory import PeakMeter

    meter, peaks, label = PeakMeter(), dict.fromkeys(PHASES, 0.0), ["rest"]

    def close(then: str) -> None:
        peak = meter.read()[1]
        if peak is None:
            raise RuntimeError("this platform does not report a process's peak memory (Linux only)")
        peaks[label[0]] = max(peaks[label[0]], peak)
        label[0] = then

    def around(fn, phase):
        def run(*args, **kwargs):
            close(phase)
            try:
                return fn(*args, **kwargs)
            finally:
                close("rest")

        return run

    backward, logits, step = torch.Tensor.backward, learner._logits, learner._clip_and_step

    def projecting(*args, **kwargs):  # a forward lasts to the backward (the loss included)
        if label[0] != "forward":
            close("forward")
        return logits(*args, **kwargs)

    learner._logits = projecting
    torch.Tensor.backward = around(backward, "backward")
    learner._clip_and_step = around(step, "optimizer step")
    try:
        close("rest")
        metrics = learner.train(batch)
        close("rest")
    finally:
        torch.Tensor.backward = backward
        learner._logits, learner._clip_and_step = logits, step
    return peaks, metrics


def phase_study(model: str, batch, micro_batch_tokens: int, updates: int) -> list[dict]:
    """:func:`phase_peaks` of ``updates`` updates of the main job's learner settings."""
    from ray_credit.actors.learner import Learner, LearnerConfig
    from ray_credit.models import load_model

    config = LearnerConfig(
        lr=1e-5, temperature=0.8, off_policy="tis", autocast="auto",
        micro_batch_tokens=micro_batch_tokens,
    )  # fmt: skip
    learner = Learner(load_model(model), config)
    rows = []
    for i in range(updates):
        start = time.perf_counter()
        peaks, metrics = phase_peaks(learner, batch)
        rows.append({"update": i + 1, "seconds": time.perf_counter() - start, "peaks_gb": peaks,
                     "after_gb": metrics["memory/learner_rss_gb"]})  # fmt: skip
        print(f"update {i + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in peaks.items())
              + f" GiB at their peaks; {rows[-1]['after_gb']:.2f} held after", flush=True)  # fmt: skip
    return rows


def _status_gb(field: str) -> float:
    """A memory field of this process's /proc status (VmRSS, VmHWM: its peak), in GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def memory_study(args) -> None:
    """``--micro-batch-memory``: each value in its own process, then the ratios."""
    results = []
    for value in args.micro_batch_memory:
        child = subprocess.run(
            [sys.executable, __file__, "--model", args.model, "--questions", str(args.questions),
             "--group_size", str(args.group_size), "--repeats", str(args.repeats),
             "--memory-of", str(value)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if child.returncode:
            raise RuntimeError(f"micro_batch_tokens={value} failed:\n{child.stderr[-3000:]}")
        results.append(json.loads(child.stdout.strip().splitlines()[-1]))
    first = results[0]
    for r in results:
        r["peak_ratio"] = r["peak_gb"] / first["peak_gb"]
        r["time_ratio"] = r["seconds"] / first["seconds"]
        print(f"micro_batch_tokens {r['micro_batch_tokens']:>6}: peak {r['peak_gb']:.2f} GiB "
              f"({r['peak_ratio']:.2f}x), update {r['seconds']:.1f} s ({r['time_ratio']:.2f}x), "
              f"{r['loaded_gb']:.2f} GiB once loaded, {r['after_update_gb']:.2f} after an update")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out = args.out.with_name(args.out.stem + "_memory.json")
    out.write_text(json.dumps({"model": args.model, "memory": results}, indent=2))
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--group_size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "learner.json")
    parser.add_argument(
        "--micro-batch-memory", type=lambda v: [int(x) for x in v.split(",")], default=None,
        metavar="N,N", help="peak memory and update time per micro_batch_tokens value",
    )  # fmt: skip
    parser.add_argument(
        "--phases", type=int, default=None, metavar="N",
        help="each update's peak memory by phase at micro_batch_tokens N (--repeats + 1 updates)",
    )  # fmt: skip
    parser.add_argument("--memory-of", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.micro_batch_memory:
        return memory_study(args)

    batch = demonstrations(args.model, args.questions, args.group_size)
    if args.phases is not None:
        rows = phase_study(args.model, batch, args.phases, args.repeats + 1)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        out = args.out.with_name(args.out.stem + "_phases.json")
        out.write_text(json.dumps({"model": args.model, "micro_batch_tokens": args.phases,
                                   "trajectories": len(batch), "updates": rows}, indent=2))  # fmt: skip
        print(f"wrote {out}")
        return None
    if args.memory_of is not None:  # a child of --micro-batch-memory: one JSON line
        print(json.dumps(peak_memory(args.model, batch, args.memory_of, args.repeats)))
        return None
    lengths = np.diff(batch.token_offsets)
    padded, real = len(batch) * int(lengths.max()), int(lengths.sum())
    print(f"{len(batch)} trajectories, {real} tokens ({padded} padded to the longest), "
          f"{int(batch.token_values('loss_mask').sum())} trained")  # fmt: skip
    cases = {
        "float32, every position": (None, "every", False),
        "float32, trained span": (None, "span", False),
        "bf16 autocast, trained span": ("bfloat16", "span", False),
        "+ shared prompt": ("bfloat16", "span", True),
        "+ trained positions only": ("bfloat16", "trained", True),
    }
    results = {}
    for name, (autocast, projection, share) in cases.items():
        s = time_updates(
            args.model, batch, autocast=autocast, projection=projection, share=share,
            repeats=args.repeats,
        )  # fmt: skip
        results[name] = {
            "seconds": s,
            "real_tokens_per_s": real / s,
            "padded_tokens_per_s": padded / s,
        }
    base = results["float32, every position"]["seconds"]
    for name, r in results.items():
        r["speedup"] = base / r["seconds"]
        print(
            f"{name:<30} {r['seconds']:6.2f} s  {r['real_tokens_per_s']:6.0f} tokens/s  {r['speedup']:.2f}x"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "trajectories": len(batch),
                                    "tokens": real, "results": results}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
