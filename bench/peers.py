"""ray_credit against TRL's GRPOTrainer on the same multi-turn search job, one after the
other, in one command:

    python bench/peers.py                                  # 4 steps of 16 questions x G=8
    python bench/peers.py --steps 1 --questions 2 --group-size 2 --eval-questions 8 \
        --warm_start.questions 8 --warm_start.epochs 1     # minutes: the bench test's size

Any flag this script does not take is a setting of the task, as ``pipelines/tspo.py``
takes it, and goes to both systems (and to the evaluations, where it is a data setting).

Both start from the same policy: the main job's warm-start (made once by the ray_credit
run, in ``--out/warm_start``, and reused by every later run of this command with the same
settings). Then

1. **ray_credit**: ``pipelines/tspo.py`` on its embedded settings for ``--steps`` steps of
   ``--questions`` questions x ``--group-size``, evaluating the held-out questions
   before and after (its own numbers: ``metrics.jsonl``, ``summary.json``);
2. **TRL**: ``bench/peers_trl.py``, the same task with ``GRPOTrainer`` and a rollout
   function (the ``[peers]`` extra installs TRL), for as many steps of as many
   trajectories;
3. **evaluation**: ``pipelines/eval.py`` on each system's trained policy, on the same
   held-out questions, TRL's paired with ray_credit's.

Each system's processes (the job and everything it starts) are read every second for
their proportional memory (PSS: a page shared among processes counts once in the sum);
its peak is the highest such sum. Reported per system: the start-up (until the first
step begins), seconds per step (all steps, and steps 2 on), trajectories/s and trained
tokens/s over all steps, the mean reward of each step, where a step's seconds went
(generation, retrieval within it, the update, the rest), the memory peak, and held-out EM
from the same start. The last line gives the ratio of trajectories/s, ray_credit's over
TRL's. Every remaining difference between the two jobs is printed with them. JSON to
``--out/peers.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from main_job_memory import JobMemory  # noqa: E402

DIFFERENCES = (
    "estimator: ray_credit trains TSPO (the main job's; turn-level credit where a group is "
    "all wrong, GRPO's group-normalised outcome elsewhere); TRL trains GRPO (the outcome "
    "normalised per group)",
    "pipeline: ray_credit generates the next step while it trains (one step of staleness, "
    "each token weighted by learner / generator probability, capped at 2); TRL generates, "
    "then trains, on-policy",
    "dual clip: ray_credit's learner bounds the ratio of negative-advantage tokens at 3 "
    "(verl's dual clip); TRL's loss has none",
    "question order: ray_credit draws each step's questions stratified by hop count; TRL's "
    "sampler shuffles the same pool with its own seed",
    "checkpoints: ray_credit writes one after every step (its time is in the next step's "
    "seconds); TRL saves none until the end",
)


def run_measured(cmd: list[str], log: Path, allow_failure: bool = False) -> dict:
    """Run ``cmd`` (its output to ``log``; its progress lines to this terminal), reading
    its processes' memory each second: its seconds, memory peak and progress lines, each
    with the second it came at."""
    start = time.perf_counter()
    marks = []
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=ROOT)  # fmt: skip
        memory = JobMemory(proc.pid, every=1.0)
        for line in proc.stdout:
            out.write(line)
            if line.startswith(_PROGRESS):
                marks.append((time.perf_counter() - start, line.rstrip()))
                print("   ", line.rstrip(), flush=True)
        code = proc.wait()
        memory.stop()
    if code and not allow_failure:
        raise SystemExit(f"{' '.join(cmd[:2])} ... failed (exit status {code}); see {log}")
    return {"seconds": time.perf_counter() - start, "memory": memory.summary(), "marks": marks,
            "code": code}  # fmt: skip


_PROGRESS = ("step ", "trl ", "trl:", "warm-start:", "eval ", "  all ")


def ray_credit_run(args, task: list[str]) -> dict:
    out = args.out / "ray_credit"
    cmd = [
        sys.executable, str(ROOT / "pipelines" / "tspo.py"), "--name", "ray_credit",
        "--output_dir", str(args.out), "--wandb", "disabled",
        "--warm_start.folder", str(args.out / "warm_start"),
        "--pipeline.steps", str(args.steps), *task,
    ]  # fmt: skip
    job = run_measured(cmd, args.out / "ray_credit.log")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "time/step_s" in r]
    per_step = [
        {"step": int(r["pipeline/step"]), "seconds": r["time/step_s"],
         "generation_s": r.get("gen/seconds", 0.0), "retrieval_s": r.get("gen/retrieval_seconds", 0.0),
         "update_s": r.get("time/train_s", 0.0), "wait_generation_s": r.get("time/wait_generation_s", 0.0),
         "weight_sync_s": r.get("time/wait_publication_s", 0.0) + r.get("time/publish_submit_s", 0.0),
         "checkpoint_s": r.get("time/checkpoint_s", 0.0), "trained_tokens": r.get("learner/tokens", 0.0),
         "tokens": r.get("train/tokens", 0.0),
         "trajectories": r.get("gen/trajectories", 0.0), "reward": r.get("train/reward_mean")}
        for r in steps
    ]  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    return {"seconds": job["seconds"], "memory": job["memory"], "steps": per_step,
            "startup_s": _startup(job["marks"], per_step[0]["seconds"]), "summary": summary}  # fmt: skip


def _startup(marks: list[tuple[float, str]], first_step_s: float) -> float:
    """The seconds before the first step began, less the evaluation before training: when
    step 1's line came, less step 1's seconds and that evaluation's (both printed)."""
    import re

    at = next(t for t, line in marks if line.startswith("step 1/"))
    evals = [re.search(r", (\d+)s\)$", line) for _, line in marks if line.startswith("eval before")]
    return at - first_step_s - sum(float(m.group(1)) for m in evals if m)


def generation_difference(mode: str, probe: dict, autocast: str = "off") -> str:
    if mode == "vllm-colocate":
        trl = "TRL's colocated vLLM engine (TRL pushes its weights before every step)"
    else:
        how = "under the learner's bf16 autocast" if autocast == "on" else "in float32"
        trl = (
            f"TRL's model.generate on its training model {how}, every turn re-encoding its "
            "whole context (TRL's best that works here: its colocated vLLM engine failed to "
            f"take the trainer's weights: {probe.get('error')})"
        )
    return (
        "generation: ray_credit's vLLM engine in the CPU's bf16, a group's prompt and each "
        f"context's earlier turns cached; {trl}"
    )


def probe_vllm(args, task: list[str]) -> dict:
    """Whether TRL's colocated vLLM engine takes the trainer's weights here."""
    cmd = [sys.executable, str(ROOT / "bench" / "peers_trl.py"), "--model",
           str(args.out / "warm_start"), "--out", str(args.out / "trl_probe"), "--probe",
           "--generation", "vllm-colocate", "--steps", "1", "--questions", str(args.questions),
           "--group-size", str(args.group_size), "--micro-batch", str(args.micro_batch), *task]  # fmt: skip
    job = run_measured(cmd, args.out / "trl_probe.log", allow_failure=True)
    for line in reversed((args.out / "trl_probe.log").read_text().splitlines()):
        if line.startswith("{") and '"works"' in line:
            return json.loads(line)
    return {"works": False, "error": f"the probe exited with status {job['code']} before "
            f"its weight sync; see {args.out / 'trl_probe.log'}"}  # fmt: skip


def trl_run(args, task: list[str], generation: str) -> dict:
    out = args.out / "trl"
    cmd = [
        sys.executable, str(ROOT / "bench" / "peers_trl.py"), "--model", str(args.out / "warm_start"),
        "--out", str(out), "--steps", str(args.steps), "--questions", str(args.questions),
        "--group-size", str(args.group_size), "--micro-batch", str(args.micro_batch),
        "--generation", generation, "--generation-autocast", args.trl_generation_autocast, *task,
    ]  # fmt: skip
    job = run_measured(cmd, args.out / "trl.log")
    record = json.loads((out / "steps.json").read_text())
    return {"seconds": job["seconds"], "memory": job["memory"], "steps": record["steps"],
            "startup_s": record["startup_s"], "trl": record["trl"]}  # fmt: skip


def evaluate(args, model: Path, name: str, task: list[str], before: Path | None = None) -> dict:
    output = args.out / f"eval_{name}.json"
    cmd = [sys.executable, str(ROOT / "pipelines" / "eval.py"), "--model", str(model),
           "--output", str(output), *_eval_flags(task)]  # fmt: skip
    if before is not None:
        cmd += ["--before", str(before)]
    run_measured(cmd, args.out / f"eval_{name}.log")
    return json.loads(output.read_text())


def _eval_flags(task: list[str]) -> list[str]:
    """The task flags evaluation takes (its data settings)."""
    return [f for i, f in enumerate(task) if f.startswith("--data.") or
            (i and task[i - 1].startswith("--data."))]  # fmt: skip


def speed(system: dict) -> dict:
    steps = system["steps"]
    total = sum(s["seconds"] for s in steps)
    later = [s["seconds"] for s in steps[1:]] or [steps[0]["seconds"]]
    trajectories = sum(s.get("trajectories", 0) for s in steps)
    tokens = sum(s.get("trained_tokens", 0) for s in steps)
    return {
        "step_s_mean": total / len(steps),
        "step_s_mean_after_first": statistics.mean(later),
        "trajectories_per_s": trajectories / total,
        "trained_tokens_per_s": tokens / total,
        "rewards": [s.get("reward") for s in steps],
    }


def breakdown(system: dict) -> dict:
    """Where the steps' seconds went, summed over the steps: the parts on the clock (they
    add up to the steps' seconds, ``other`` the rest), each with its share, and for a
    pipeline that generates beside its update, the generation it hid (``beside``)."""
    steps = system["steps"]
    total = sum(s["seconds"] for s in steps)

    def summed(key: str) -> float:
        return sum(s.get(key, 0.0) for s in steps)

    generation = {
        "generation (without retrieval)": summed("generation_s") - summed("retrieval_s"),
        "retrieval": summed("retrieval_s"),
    }
    clock = {"update": summed("update_s"), "weight sync": summed("weight_sync_s"),
             "checkpoint": summed("checkpoint_s")}  # fmt: skip
    overlapped = any("wait_generation_s" in s for s in steps)
    if overlapped:  # generation ran beside the update: only the wait for it was on the clock
        clock["waiting for generation"] = summed("wait_generation_s")
        beside = generation
    else:
        clock, beside = {**generation, **clock}, {}
    clock["other"] = total - sum(clock.values())

    def shares(parts: dict) -> dict:
        return {k: {"seconds": v, "share": v / total if total else 0.0} for k, v in parts.items()}

    return {"total_s": total, "overlapped": overlapped, "parts": shares(clock),
            "beside": shares(beside)}  # fmt: skip


def rates(system: dict, params: int, matmul: dict) -> dict:
    """Generation's tokens/s, and the update's achieved FLOP/s (6 x parameters x the
    tokens it ran: forward and backward) against this CPU's bf16 matmul rate."""
    steps = system["steps"]
    generated = sum(s.get("trained_tokens", 0.0) for s in steps)
    gen_s = sum(s.get("generation_s", 0.0) - s.get("retrieval_s", 0.0) for s in steps)
    update_s = sum(s.get("update_s", 0.0) for s in steps)
    flops = 6 * params * sum(s.get("tokens", 0.0) for s in steps)
    achieved = flops / update_s / 1e9 if update_s else 0.0
    return {"generated_tokens_per_s": generated / gen_s if gen_s else 0.0,
            "update_gflops": achieved, "matmul_gflops": matmul,
            "update_share_of_bf16_matmul": achieved / matmul["bfloat16"]}  # fmt: skip


def matmul_gflops(size: int = 2048, repeats: int = 5) -> dict:
    """This CPU's matmul rate (GFLOP/s, best of ``repeats``) in float32 and bfloat16."""
    import torch

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
        out[str(dtype).removeprefix("torch.")] = 2 * size**3 / best / 1e9
    return out


def parameter_count(folder: Path) -> int:
    """The parameters of the safetensors weights in ``folder`` outside the embedding and
    the vocabulary projection (the usual 6 N D count of a step's work leaves those out:
    the learner projects only the positions it trains)."""
    from math import prod

    from safetensors import safe_open

    count = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            names = [k for k in f.keys() if "embed_tokens" not in k and "lm_head" not in k]  # noqa: SIM118
            count += sum(prod(f.get_slice(k).get_shape()) for k in names)
    return count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--questions", type=int, default=16, help="questions per step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=8, help="TRL's completions per backward")
    parser.add_argument("--eval-questions", type=int, default=120)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "peers")
    parser.add_argument(
        "--skip",
        choices=("ray_credit",),
        default=None,
        help="reuse ray_credit's run and evaluation from an earlier run of this "
        "command in --out, and run TRL again",
    )
    parser.add_argument("--trl-generation-autocast", choices=("on", "off"), default="off",
                        help="TRL's transformers generation in its model's float32, as TRL's own "
                             "generation samples (off), or under the learner's bf16 autocast (on: "
                             "no faster on this CPU)")  # fmt: skip
    args, extra = parser.parse_known_args()  # the rest: task settings, as tspo.py takes them
    args.out.mkdir(parents=True, exist_ok=True)
    task = [*extra, "--pipeline.groups_per_step", str(args.questions),
            "--generator.group_size", str(args.group_size),
            "--data.eval_questions", str(args.eval_questions)]  # fmt: skip
    if args.questions < 2:  # stratified steps need a question of each hop count
        task += ["--pipeline.stratify_by", "none"]

    if args.skip == "ray_credit":  # an earlier run's, from the same --out
        earlier = json.loads((args.out / "peers.json").read_text())["ray_credit"]
        rc = {k: earlier[k] for k in ("seconds", "memory", "steps", "startup_s", "summary")}
        print(f"ray_credit: reused from {args.out / 'peers.json'}", flush=True)
    else:
        print(f"ray_credit: pipelines/tspo.py, {args.steps} steps of {args.questions} x "
              f"G={args.group_size}", flush=True)  # fmt: skip
        rc = ray_credit_run(args, task)
    probe = probe_vllm(args, task)
    generation = "vllm-colocate" if probe["works"] else "transformers"
    print(
        f"TRL's colocated vLLM engine: {'works' if probe['works'] else probe['error']}", flush=True
    )
    print(f"TRL: bench/peers_trl.py ({generation} generation), the same from "
          f"{args.out / 'warm_start'}", flush=True)  # fmt: skip
    trl = {**trl_run(args, task, generation), "vllm_colocate_probe": probe}
    print("evaluation: pipelines/eval.py on each trained policy", flush=True)
    if args.skip == "ray_credit":
        rc_eval = json.loads((args.out / "eval_ray_credit.json").read_text())
    else:
        rc_eval = evaluate(args, args.out / "ray_credit" / "checkpoint", "ray_credit", task)
    trl_eval = evaluate(args, args.out / "trl" / "final", "trl", task,
                        before=args.out / "eval_ray_credit.json")  # fmt: skip

    differences = [DIFFERENCES[0], DIFFERENCES[1], generation_difference(generation, probe, args.trl_generation_autocast),
                   *DIFFERENCES[2:]]  # fmt: skip
    result = {"setup": vars(args) | {"out": str(args.out)}, "differences": differences}
    params, matmul = parameter_count(args.out / "warm_start"), matmul_gflops()
    result["setup"].update(parameters=params, matmul_gflops=matmul)
    for name, system in (("ray_credit", rc), ("trl", trl)):
        result[name] = {**system, "speed": speed(system), "breakdown": breakdown(system),
                        "rates": rates(system, params, matmul)}  # fmt: skip
    result["ray_credit"]["eval"] = {"before": rc["summary"].get("eval_before"), "after": rc_eval}
    result["trl"]["eval"] = {"after": trl_eval}
    ratio = (
        result["ray_credit"]["speed"]["trajectories_per_s"]
        / result["trl"]["speed"]["trajectories_per_s"]
    )
    result["ratio_trajectories_per_s"] = ratio
    (args.out / "peers.json").write_text(json.dumps(result, indent=2, default=str))
    report(result)
    print(f"ratio: ray_credit {ratio:.2f}x TRL's trajectories/s over all {args.steps} steps "
          f"(wrote {args.out / 'peers.json'})")  # fmt: skip
    return 0


def report(result: dict) -> None:
    print()
    print(f"{'':<24}{'ray_credit':>14}{'TRL':>14}")
    rows = [
        ("start-up, s", lambda s: s["startup_s"]),
        ("s/step, all steps", lambda s: s["speed"]["step_s_mean"]),
        ("s/step, steps 2 on", lambda s: s["speed"]["step_s_mean_after_first"]),
        ("trajectories/s", lambda s: s["speed"]["trajectories_per_s"]),
        ("trained tokens/s", lambda s: s["speed"]["trained_tokens_per_s"]),
        ("memory peak (PSS), GB", lambda s: (s["memory"] or {}).get("peak_pss_gb", float("nan"))),
        ("held-out EM after", lambda s: _em(s["eval"]["after"])),
    ]
    for label, get in rows:
        print(f"{label:<24}{get(result['ray_credit']):>14.3f}{get(result['trl']):>14.3f}")
    for name in ("ray_credit", "trl"):
        rewards = ", ".join(f"{r:.3f}" for r in result[name]["speed"]["rewards"] if r is not None)
        print(f"{name} mean reward per step: {rewards}")
        split = result[name]["breakdown"]
        print(f"{name} where the steps' {split['total_s']:.0f}s went: "
              + ", ".join(f"{k} {v['seconds']:.0f}s ({v['share']:.0%})" for k, v in split["parts"].items()))  # fmt: skip
        if split["beside"]:
            print(f"{name} beside the update (off the clock): "
                  + ", ".join(f"{k} {v['seconds']:.0f}s" for k, v in split["beside"].items()))  # fmt: skip
        r = result[name]["rates"]
        print(f"{name} generation {r['generated_tokens_per_s']:.0f} generated tokens/s; update "
              f"{r['update_gflops']:.0f} GFLOP/s, {r['update_share_of_bf16_matmul']:.0%} of this "
              f"CPU's bf16 matmul rate ({r['matmul_gflops']['bfloat16']:.0f} GFLOP/s)")  # fmt: skip
    change = (result["trl"]["eval"]["after"].get("change") or {}).get("all")
    if change:
        print(f"held-out EM, TRL's minus ray_credit's, paired on the same {change['n']} "
              f"questions: {change['diff']:+.3f} [95% CI {change['low']:+.3f}, {change['high']:+.3f}]")  # fmt: skip
    before = result["ray_credit"]["eval"]["before"]
    if before:
        print(f"held-out EM from the same start (the warm-start): {before['em']:.3f}")
    print("differences between the two jobs:")
    for line in result["differences"]:
        print(f"  - {line}")


def _em(evaluation: dict | None) -> float:
    if not evaluation:
        return float("nan")
    for key in ("em", "EM", "exact_match"):
        if key in evaluation:
            return float(evaluation[key])
    return float(evaluation.get("all", {}).get("em", float("nan")))


if __name__ == "__main__":
    raise SystemExit(main())
