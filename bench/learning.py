"""The credit estimators against GRPO on the embedded task: same data, budget and seeds.

    python bench/learning.py                        # every method x 3 seeds (hours here)
    python bench/learning.py --methods grpo,tspo --seeds 0,1,2,3,4
    python bench/learning.py --quick                # smoke test: tiny-random, 1 step, 1 seed
    python bench/learning.py --set pipeline.steps=12 --set learner.lr=3e-5
    python bench/learning.py --methods tspo --set learner.lr=3e-5 --runs-dir runs/lr3e-5 \
        --against runs/study/runs.jsonl             # a setting against the study's runs
    python bench/learning.py --methods grpo --against runs/tspo/runs.jsonl --against-method tspo
    python bench/learning.py --config pipelines/configs/sparse.yaml \
        --compose "tspo_ig=(folr | turn_position) + 0.3*(info_gain | turn_position(padding=none))"

Each (method, seed) is one training run of ``pipelines/<method>.py`` on its paper's
recipe, with the embedded settings (``ray_credit/configs/embedded.yaml``, or ``--config``'s
file) plus any ``--set section.field=value``, and ``--pipeline.seed``, ``--generator.seed`` and
``--learner.seed`` set to the seed (the seed also picks the held-out split, so a seed's
runs of every method are evaluated on the same questions). Judged methods use the
evidence judge, which needs no model. All runs share one local Ray (or RAY_ADDRESS's).
``--compose NAME=COMPOSITION`` adds a method of your own: a composition of credit parts
(docs/estimators.md) trained by ``pipelines/compose.py``, its parts' recipe included.

Reports, per method: held-out EM after training across seeds (the mean over seeds, with
an interval resampling the seeds, then each drawn seed's questions; per data source:
1-, 2- and 3-hop apart, with a t-interval over the seeds' means), its change from before
training and, for each method but GRPO, its EM after training minus GRPO's on the same
seeds' questions (the mean over seeds of each seed's paired change, the same two-level
interval; on one seed, the paired bootstrap and the sign test), the training reward per
step (mean and a band of one std across seeds), the share of all-wrong groups and of
zero-advantage groups, searches per question by hop type, and wall time per run. Writes
JSON (``--out``), the tables as Markdown beside it, and one PNG (``--plot``): reward curves
with bands, and every seed's paired change with the mean and its interval.

``--against RUNS.jsonl`` (the record of another study, made with other settings) measures
a setting: each method's EM after training minus the same method's EM after training in
that study, on the same seeds' held-out questions (paired, over the seeds both studies
ran, with the same two-level interval). Runs share their warm-start when both studies
were given the same one (``--runs-dir`` holding the other's ``warm_start-seedN`` folders,
or links to them), so that the difference is the setting's alone; the report says on which
seeds they did (their weights' SHA-256). ``--against-method M`` compares every method with
M's runs there instead (GRPO run here against TSPO's runs there, on the same settings and
warm-start: a method against another, run in two studies), and refuses runs that started
from other warm-starts.

The runs go seed by seed (every method of seed 0, then of seed 1, ...), and each finished
run is recorded in ``<runs-dir>/runs.jsonl`` as it ends, with its ``--set`` and a
fingerprint of ``embedded.yaml``. Started again with the same ``--runs-dir`` and settings,
the study reuses the recorded runs and redoes only the rest, so a study of hours survives a
lost machine; a record made with other settings or from another ``embedded.yaml`` is
refused, not mixed in. On another machine, the record and each seed's
``warm_start-seedN`` folder carry the study on. With the record alone, each seed's
warm-start is made again there, and the study goes on only where it gives the same
weights: a run whose warm-start weights (their SHA-256) or evaluation before training are
not those the recorded runs of its seed started from is refused (another CPU or torch
build can make other weights from the same settings), before training where the
warm-start is already there, and after it otherwise (not recorded, its folder set
aside). A run saves a checkpoint after every step (only the newest is kept), and a run
cut off half-way continues from it (``--resume``: its evaluation before training,
metrics, data cursor and the chunks generated ahead of training come back; the record lists
its starts, and its wall time, cut off, is unknown: the table's s/run reads n/a where a
run was resumed, its RL s/run sums every step); one cut off before its first checkpoint
starts over.

``--report RUNS.jsonl`` runs nothing and reports a record. Where a seed's remaining runs
had to be made on a machine that cannot make that seed's warm-start again, run them there
in a study of their own with GRPO (``--methods grpo,cw_grpo --seeds 2``), then give both
records: ``--report study.jsonl --report elsewhere.jsonl``. A run of the later record is
compared with GRPO's run from its own warm-start, the others with GRPO's from the study's;
GRPO's row keeps the study's run, and the report sets GRPO's two runs of the seed against
each other, paired on its questions: what the start alone moved.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean, stdev
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

METHODS = {  # method -> (pipeline script, its run config class)
    "grpo": ("grpo.py", "GRPORun"),
    "tspo": ("tspo.py", "TSPORun"),
    "cw_grpo": ("cw_grpo.py", "CWGRPORun"),
    "search_p1": ("search_p1.py", "SearchP1Run"),
    "igpo": ("igpo.py", "IGPORun"),
    "a2tgpo": ("a2tgpo.py", "A2TGPORun"),
}
BASELINE = "grpo"  # what every other method is compared with, question by question
QUICK = [  # a smoke run of the machinery (pytest -m bench): nothing learns in one step
    "model=tiny-random", "pipeline.steps=1", "pipeline.groups_per_step=2",
    "data.eval_questions=4", "data.world.num_entities=20", "generator.backend=transformers",
    "resources.generator_cpus=0.5", "resources.learner_cpus=0.5", "resources.eval_cpus=0.5",
    "warm_start.questions=8", "warm_start.epochs=1",
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--methods", default=None, help="default: every paper's, then --compose's")
    parser.add_argument(
        "--compose", action="append", default=[], metavar="NAME=COMPOSITION",
        help="a method of your own (repeatable): a composition of credit parts, e.g. "
        "'tspo_ig=(folr | turn_position) + 0.3*(info_gain | turn_position(padding=none))'",
    )  # fmt: skip
    parser.add_argument(
        "--config", type=Path, default=EMBEDDED, metavar="FILE.yaml",
        help="the settings every run starts from (default: the embedded run's)",
    )  # fmt: skip
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument(
        "--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
        help="a setting for every run (repeatable), e.g. pipeline.steps=12",
    )  # fmt: skip
    parser.add_argument(
        "--against", type=Path, default=None, metavar="RUNS.jsonl",
        help="another study's record: each method's EM after training is compared with "
        "that study's same method and seeds, question by question",
    )  # fmt: skip
    parser.add_argument(
        "--against-method", default=None, choices=sorted(METHODS),
        help="with --against: compare every method with this method's runs in that record "
        "(default: each with its own), e.g. GRPO here against TSPO there",
    )  # fmt: skip
    parser.add_argument(
        "--report", type=Path, action="append", default=[], metavar="RUNS.jsonl",
        help="run nothing: the tables and plot of a recorded study (its --methods and "
        "--seeds), computed by this version, whatever settings it was recorded with; "
        "repeatable: a later record adds runs of the study's seeds made from another "
        "warm-start (another machine's), each paired with the baseline's run from its start",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="smoke test: " + " ".join(QUICK))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "learning.json")
    parser.add_argument("--plot", type=Path, default=None, help="default: --out with .png")
    parser.add_argument("--runs-dir", type=Path, default=None, help="default: a temp folder")
    parser.add_argument(
        "--keep-checkpoints", action="store_true",
        help="keep each finished run's checkpoint (about 1.6 GB for SmolLM2: the policy and "
        "AdamW's state); by default it is deleted once the run is recorded",
    )  # fmt: skip
    args = parser.parse_args(argv)
    from ray_credit.estimators.compose import compose

    composed = {}
    for item in args.compose:
        name, _, text = item.partition("=")
        if not name.isidentifier() or not text.strip() or name in METHODS:
            parser.error(
                f"--compose takes NAME=COMPOSITION with a new name, got {item!r} (the papers' "
                f"names are taken: {sorted(METHODS)})"
            )
        try:
            compose(text)
        except ValueError as err:
            parser.error(f"--compose {name}: {err}")
        composed[name] = text
    known = {**METHODS, **composed}
    methods = [m for m in (args.methods or ",".join(known)).split(",") if m]
    unknown = sorted(set(methods) - set(known))
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {sorted(known)} (or --compose)")
    if not args.config.is_file():
        parser.error(f"--config {args.config}: no such file")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        parser.error(f"--seeds takes comma-separated integers, got {args.seeds!r}")
    if args.quick:
        seeds = seeds[:1]
    settings = (QUICK if args.quick else []) + args.set
    for item in settings:
        if "=" not in item:
            parser.error(f"--set takes SECTION.FIELD=VALUE, got {item!r}")
        if item.split("=", 1)[0] in ("name", "output_dir", "wandb", "resume", "warm_start.folder"):
            parser.error(f"--set {item}: the study names and places its runs (--runs-dir)")
    against = {}
    if args.against is not None:
        try:
            against = recorded_runs(args.against, None)
        except (OSError, ValueError) as err:
            parser.error(f"--against {args.against}: {err}")
        if not against:
            parser.error(f"--against {args.against}: no such study record (runs.jsonl)")
        if args.against_method and not any(m == args.against_method for m, _ in against):
            parser.error(f"--against {args.against} holds no {args.against_method} runs")
    elif args.against_method:
        parser.error("--against-method needs --against RUNS.jsonl")
    started = time.perf_counter()
    if args.report:
        try:
            recorded, other_starts = read_reports(args.report)
        except (OSError, ValueError) as err:
            parser.error(str(err))
        missing = [f"{m} seed {s}" for s in seeds for m in methods if (m, s) not in recorded]
        if missing:
            parser.error(
                f"--report {', '.join(map(str, args.report))} holds no "
                + ", ".join(missing[:4])
                + (f" (and {len(missing) - 4} more)" if len(missing) > 4 else "")
                + ": give the --methods and --seeds it recorded"
            )
        settings = recorded[methods[0], seeds[0]]["settings"]
        return _report(args, parser, seeds, settings, composed, against,
                       {m: [recorded[m, s] for s in seeds] for m in methods}, started,
                       other_starts)  # fmt: skip
    runs_dir = args.runs_dir or Path(tempfile.mkdtemp(prefix="learning_"))
    runs_dir.mkdir(parents=True, exist_ok=True)
    try:
        fingerprint = defaults_fingerprint(args.config)
        done = recorded_runs(runs_dir / RECORD, settings, fingerprint)
    except ValueError as err:
        parser.error(str(err))

    runs: dict[str, list[dict]] = {m: [] for m in methods}
    for seed in seeds:  # seed-major: an unfinished study has every method on its first seeds
        for method in methods:
            if (method, seed) in done:
                if _canonical(done[method, seed].get("estimator")) != _canonical(
                    composed.get(method)
                ):
                    parser.error(
                        f"{runs_dir / RECORD} records {method} seed {seed} with the estimator "
                        f"{done[method, seed].get('estimator')!r}, not {composed.get(method)!r}; "
                        "give that method another name or another --runs-dir"
                    )
                print(f"{method} seed {seed}: reused from {runs_dir / RECORD}", flush=True)
                reused = done[method, seed]
                metrics = runs_dir / run_name(method, seed) / "metrics.jsonl"
                if "rl_seconds" not in reused and metrics.is_file():  # recorded before it was
                    from ray_credit.pipeline.outputs import read_metrics

                    reused = {**reused, "rl_seconds": rl_seconds(read_metrics(metrics))}
                runs[method].append(reused)
                continue
            same_seed = [{**r, "method": m} for (m, s), r in done.items() if s == seed] + [
                {**r[-1], "method": m} for m, r in runs.items() if r and r[-1]["seed"] == seed
            ]
            made_here = runs_dir / f"warm_start-seed{seed}"
            digests = any(r.get("warm_start_sha256") for r in same_seed)
            if digests and (made_here / "warm_start.json").is_file():  # check before training
                from ray_credit.warm_start import weights_digest

                why = different_start({"warm_start_sha256": weights_digest(made_here)}, same_seed)
                if why:
                    parser.error(_not_their_start(method, seed, why, made_here))
            run = run_one(method, seed, settings, runs_dir, args.config, composed.get(method))
            why = different_start(run, same_seed)
            if why:  # not recorded, and its folder set aside: it must not be resumed
                folder = runs_dir / run_name(method, seed)
                aside = folder.with_name(f"{folder.name}.refused-{time.strftime('%Y%m%d-%H%M%S')}")
                folder.rename(aside)
                parser.error(_not_their_start(method, seed, why, made_here, aside))
            with (runs_dir / RECORD).open("a") as record:
                row = {"method": method, "settings": settings, "defaults": fingerprint}
                record.write(json.dumps({**row, **run}) + "\n")
            runs[method].append(run)
            if not args.keep_checkpoints:  # the study reads summary.json and metrics.jsonl
                shutil.rmtree(runs_dir / run_name(method, seed) / "checkpoint", ignore_errors=True)
    return _report(args, parser, seeds, settings, composed, against, runs, started)


def different_start(run: dict, others: list[dict]) -> str | None:
    """Why ``run`` did not start where ``others`` (runs of its seed) did, or None: another
    warm-start's weights (their SHA-256, where both runs recorded it) or another evaluation
    before training. The same settings made again on another CPU or torch build can give
    other weights, and a seed's runs are compared question by question from one start."""
    for other in others:
        mine, theirs = run.get("warm_start_sha256"), other.get("warm_start_sha256")
        if mine and theirs and mine != theirs:
            return (
                f"its warm-start's weights (SHA-256 {mine[:12]}...) are not those "
                f"{other.get('method', 'another run')} started from ({theirs[:12]}...)"
            )
        mine, theirs = run.get("correct_before"), other.get("correct_before")
        if mine is not None and theirs is not None and mine != theirs:
            return "its evaluation before training answered other questions right"
    return None


def warm_starts(runs: list[dict], theirs: list[dict]) -> dict[int, str]:
    """For each seed that ``runs`` and ``theirs`` (another study's runs) both ran: "other"
    where two of those runs recorded different warm-start weights (their SHA-256), else
    "unknown" where one recorded none (made before it was kept), else "same"."""
    digests: dict[int, tuple[list, list]] = {}
    for side, rs in enumerate((runs, theirs)):
        for run in rs:
            digests.setdefault(run["seed"], ([], []))[side].append(run.get("warm_start_sha256"))
    kinds = {}
    for seed, (mine, other) in sorted(digests.items()):
        if not (mine and other):
            continue
        known = {d for d in mine + other if d}
        kinds[seed] = "other" if len(known) > 1 else "unknown" if None in mine + other else "same"
    return kinds


def _seeds(seeds) -> str:
    return ", ".join(str(s) for s in sorted(seeds))


def _not_their_start(
    method: str, seed: int, why: str, warm_start: Path, aside: Path | None = None
) -> str:
    """The refusal of a run that does not start where its seed's recorded runs did."""
    if "weights" in why:
        cause = (
            f"the warm-start in {warm_start} is not theirs (made again, on another machine "
            "or torch build, the same settings can give other weights): bring the "
            f"{warm_start.name} folder the record's runs started from, or give another "
            "--runs-dir"
        )
    else:
        cause = (
            "its warm-start's weights are theirs, so the evaluation itself answered "
            "otherwise (other evaluation settings, or an engine that does not repeat its "
            "greedy answers here): its runs are not comparable with the record's; give "
            "another --runs-dir"
        )
    kept = f" The run, not recorded, is set aside in {aside}." if aside else ""
    return (
        f"{method} seed {seed} does not start where the recorded runs of seed {seed} did: "
        f"{why}; {cause}.{kept}"
    )


def _report(
    args, parser, seeds, settings, composed, against, runs, started, other_starts=()
) -> int:
    """The study's report of ``runs`` (method -> its runs, one per seed): JSON, tables and
    plot, each method paired with GRPO's and with --against's runs. ``other_starts``: the
    baseline's runs of a seed from another warm-start (a later ``--report`` record's),
    each the pair of the runs of its seed that started where it did."""
    if other_starts and BASELINE not in runs:
        parser.error(f"runs from other starts are paired with {BASELINE}'s: add it to --methods")
    # method -> the baseline's run that each of its runs is paired with
    pairs: dict[str, list[dict]] = {}
    if BASELINE in runs:  # each run against the baseline's run of its seed and start
        baselines = [*runs[BASELINE], *other_starts]
        for method, rs in runs.items():
            pairs[method] = [paired_baseline(run, baselines) for run in rs]
            for run, pair in zip(rs, pairs[method], strict=True):
                if pair is None:
                    seed = run["seed"]
                    why = different_start(run, [b for b in baselines if b["seed"] == seed])
                    parser.error(f"{method} seed {seed} did not start where the seed's "
                                 f"{BASELINE} run did ({why}): they are not one study's runs; "
                                 f"a run from another start needs {BASELINE}'s run from it "
                                 "(in its own --report record)")  # fmt: skip
    else:
        for seed in seeds:
            of_seed = [{**r[i], "method": m} for m, r in runs.items() for i in range(len(r))
                       if r[i]["seed"] == seed]  # fmt: skip
            for i, run in enumerate(of_seed[1:], 1):
                why = different_start(run, of_seed[:i])
                if why:
                    parser.error(f"{run['method']} seed {seed} did not start where the seed's "
                                 f"other runs did ({why}): they are not one study's runs")  # fmt: skip
    used = []  # the other starts' baseline runs that a run is paired with, and by whom
    for alt in other_starts:
        methods = [m for m, theirs in pairs.items() if any(p is alt for p in theirs)]
        if methods:
            used.append({**alt, "paired_with": methods})
    report = {
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "settings": settings,
        "config": str(args.config),
        "compositions": composed,
        "seeds": seeds,
        "methods": {m: aggregate(rs) for m, rs in runs.items()},
        "baseline": BASELINE if BASELINE in runs else None,
        "runs": runs,
        "seconds": time.perf_counter() - started,
    }
    if used:
        report["other_starts"] = used
    for method, agg in report["methods"].items():  # each method against GRPO, paired
        if method != BASELINE and BASELINE in runs:
            parts = ["all", *agg["em_after_by_source"]]
            agg["vs_baseline"] = {
                part: pooled(runs[method], pairs[method], source=None if part == "all" else part)
                for part in parts
            }
    for alt in used:  # the baseline from two starts of one seed: what the start alone moves
        study = next(r for r in runs[BASELINE] if r["seed"] == alt["seed"])
        alt["vs_study_start"] = {
            part: pooled([alt], [study], source=None if part == "all" else part)
            for part in ["all", *alt["em_after_by_source"]]
        }
    if against:  # each method against its own (or --against-method's) runs there, paired
        report["against"] = {"record": str(args.against),
                             "settings": next(iter(against.values()))["settings"],
                             "method": args.against_method}  # fmt: skip
        starts = {"same": set(), "other": set(), "unknown": set()}
        for method, agg in report["methods"].items():
            other = args.against_method or method
            theirs = [run for (m, _), run in sorted(against.items()) if m == other]
            kinds = warm_starts(runs[method], theirs)
            for seed, kind in kinds.items():
                starts[kind].add(seed)
            elsewhere = [seed for seed, kind in kinds.items() if kind == "other"]
            if args.against_method and elsewhere:
                parser.error(
                    f"--against {args.against}: {method} here and its {other} runs there "
                    f"started from other warm-starts on seed(s) {_seeds(elsewhere)} "
                    "(their weights' SHA-256 differ), so their difference is not the "
                    "methods' alone; give this study that record's warm_start-seedN folders "
                    "(in its --runs-dir) and run it again"
                )
            parts = ["all", *agg["em_after_by_source"]]
            try:
                agg["vs_against"] = {
                    part: pooled(runs[method], theirs, source=None if part == "all" else part)
                    for part in parts
                }
            except ValueError as err:
                parser.error(f"--against {args.against}: {method}: {err}")
        # a seed counts as one start only if every method's runs of it shared theirs; one
        # known difference makes it another start, whatever the runs that recorded none
        starts["unknown"] -= starts["other"]
        starts["same"] -= starts["other"] | starts["unknown"]
        report["against"]["warm_start"] = {k: sorted(v) for k, v in starts.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    plot_path = args.plot or args.out.with_suffix(".png")
    plot_curves(report, plot_path)
    text = table(report)
    args.out.with_suffix(".md").write_text(text + "\n")
    print(text)
    print(f"wrote {args.out}, {args.out.with_suffix('.md')} and {plot_path}")
    return 0


RECORD = "runs.jsonl"
EMBEDDED = ROOT / "ray_credit" / "configs" / "embedded.yaml"  # what every run starts from


def defaults_fingerprint(config: Path = EMBEDDED) -> str:
    """The fingerprint of the settings every run starts from (``--config``'s file, as
    parsed: its comments are not settings), kept with each recorded run: the same --set
    on other settings is another study (recorded runs are not reused across them)."""
    import yaml

    settings = yaml.safe_load(config.read_text())
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def _canonical(text: str | None) -> str | None:
    """A composition as the library writes it (spacing and default settings aside)."""
    from ray_credit.estimators.compose import parse

    return None if text is None else str(parse(text))


def recorded_runs(
    path: Path, settings: list[str] | None, defaults: str | None = None
) -> dict[tuple[str, int], dict]:
    """The finished runs recorded in ``path`` by an earlier start of this study, by
    (method, seed). Runs of other settings, or made from other embedded settings (their
    ``defaults`` fingerprint is not ``defaults``), are refused: they would not be
    comparable (``settings`` None: another study's record, read whatever its settings,
    which each run then carries)."""
    if not path.is_file():
        return {}
    text = path.read_text()
    if settings is not None and text and not text.endswith("\n"):
        # cut off while written: the next record must not be glued onto the fragment
        path.write_text(text[: text.rfind("\n") + 1])
    done = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # the last line of a record cut off while written
            print(f"{path}:{number}: not a whole record, ignored (that run is redone)")
            continue
        if not isinstance(row, dict) or not {"method", "settings", "seed"} <= set(row):
            raise ValueError(
                f"{path}:{number}: not a run record of this study (one JSON object with "
                "method, settings, seed, ... per line); remove the line or give another "
                "--runs-dir"
            )
        if settings is not None and row["settings"] != settings:
            raise ValueError(
                f"{path} records runs with the settings {row['settings']}, not {settings}; "
                "give the same --set (and --quick) as the study that made it, or another "
                "--runs-dir"
            )
        if settings is not None and row.get("defaults") != defaults:
            raise ValueError(
                f"{path}:{number} was recorded from other starting settings (the --config "
                f"file's fingerprint {row.get('defaults')}, now {defaults}): its runs are "
                "another study's; give the same --config, another --runs-dir, or read it "
                "with --against"
            )
        run = {k: v for k, v in row.items() if k not in ("method", "settings", "defaults")}
        if settings is None:
            run["settings"] = row["settings"]
        folder = path.parent / run_name(row["method"], run["seed"])
        if (folder / "summary.json").is_file():  # read again: figures added since count too
            run = {**run, **collect(folder, row["method"])}
        done[row["method"], run["seed"]] = run
    return done


def run_name(method: str, seed: int) -> str:
    return f"{method}-seed{seed}"


def run_one(
    method: str,
    seed: int,
    settings: list[str],
    runs_dir: Path,
    config: Path = EMBEDDED,
    composition: str | None = None,
) -> dict:
    """One training run; what the study keeps of it. It saves a checkpoint after every
    step, the newest kept. A folder left by a run that did not finish (it is not in the
    record) is resumed from its newest whole checkpoint, or cleared when it holds none.
    ``composition``: the method is that composition of parts, trained by
    ``pipelines/compose.py``."""
    from ray_credit.estimators.compose import compose
    from ray_credit.pipeline.checkpointing import checkpoints
    from ray_credit.pipeline.cli import run_config_class
    from ray_credit.pipeline.configs import load_config
    from ray_credit.pipeline.recipe import train

    script, cls_name = ("compose.py", "ComposeRun") if composition else METHODS[method]
    run_cls = run_config_class(ROOT / "pipelines" / script, cls_name)
    argv = [
        "--name", run_name(method, seed), "--output_dir", str(runs_dir), "--wandb", "disabled",
        "--pipeline.seed", str(seed), "--generator.seed", str(seed), "--learner.seed", str(seed),
        # one warm-start per seed (the seed picks the held-out split), shared by the methods
        "--warm_start.folder", str(runs_dir / f"warm_start-seed{seed}"),
        # a study of hours outlives its machine: at most one step is lost to a cut
        "--pipeline.checkpoint_every", "1", "--pipeline.keep_checkpoints", "1",
    ]  # fmt: skip
    for item in settings:
        key, value = item.split("=", 1)
        argv += [f"--{key}", value]
    estimator = method
    if composition:
        argv += ["--estimator", composition]
        estimator = compose(composition)
    stale = runs_dir.resolve() / run_name(method, seed)  # where train writes (--set cannot move it)
    saved = checkpoints(stale / "checkpoint") if (stale / "checkpoint").is_dir() else []
    if saved:
        step, folder = saved[-1]
        print(f"{method} seed {seed}: {stale} is left from a run that did not finish; "
              f"resumed from its checkpoint after step {step}", flush=True)  # fmt: skip
        argv += ["--resume", str(folder)]
    elif stale.exists():
        print(f"{method} seed {seed}: {stale} is left from a run that did not finish before "
              "its first checkpoint; redone", flush=True)  # fmt: skip
        shutil.rmtree(stale)
    cfg = load_config(run_cls, estimator, argv, default_config=config)
    if saved:
        _check_same_start(stale, cfg)
    start = time.perf_counter()
    train(cfg, estimator)
    kept = {"estimator": composition} if composition else {}
    run = {"seed": seed, "seconds": time.perf_counter() - start, **kept, **collect(stale, method)}
    starts = json.loads((stale / "summary.json").read_text()).get("starts", [])
    if len(starts) > 1:  # the wall time of the starts cut off is not known: rl_seconds,
        # which sums every step's, still is
        run["starts"] = [s.get("resumed_from") for s in starts]
        run["seconds"], run["last_start_seconds"] = None, run["seconds"]
    return run


def _check_same_start(folder: Path, cfg: Any) -> None:
    """Refuse, before it trains, to resume a run whose change would not be measured from
    its start: one whose settings that decide its evaluations differ from its first start's
    (the resume would evaluate the resumed policy instead), or one resumed so before."""
    from dataclasses import asdict

    from ray_credit.pipeline.outputs import kept_evaluations, previous_summary

    previous = previous_summary(folder)
    before = previous.get("eval_before", {})
    if before.get("step") or "eval_before" not in kept_evaluations(previous, asdict(cfg)):
        raise ValueError(
            f"{folder}: its change would not be measured from its start (its evaluation before "
            "training is missing, was made where it resumed, or was made with other data, "
            "generator, retriever, evaluation or warm-start settings than these); remove the "
            "folder to run it again with these settings"
        )


def collect(folder: Path, method: str) -> dict:
    """What the study keeps of a finished run, read from its folder (summary.json and
    metrics.jsonl): held-out EM before and after (all and per data source) with the
    paired changes, searches per trajectory, and per step the training reward, the shares
    of all-wrong and zero-advantage groups and the estimator's own counters."""
    summary = json.loads((folder / "summary.json").read_text())
    before, after, change = summary["eval_before"], summary["eval_after"], summary["eval_change"]
    if before.get("step"):
        raise ValueError(
            f"{folder}: its evaluation before training was made at step {before['step']}, where "
            "it was resumed with other settings, so its change is not from the run's start; "
            "remove the folder (and its line in runs.jsonl, if it has one) to run it again"
        )
    from ray_credit.pipeline.outputs import read_metrics

    rows = read_metrics(folder / "metrics.jsonl")
    from ray_credit.estimators.parts import PARTS

    prefixes = (f"{summary['estimator']}/", *(f"{part}/" for part in PARTS))  # a composition's
    counters = sorted({k for r in rows for k in r if k.startswith(prefixes)})
    return {
        "em_before": before["em"],
        "em_before_by_source": before["em_by_source"],
        "em_after": after["em"],
        "em_after_by_source": after["em_by_source"],
        "em_change": change["all"],
        "em_change_by_source": {k: v for k, v in change.items() if k != "all"},
        "searches_before": before.get("searches_per_traj"),
        "searches_after": after.get("searches_per_traj"),
        "searches_before_by_source": before.get("searches_by_source"),
        "searches_after_by_source": after.get("searches_by_source"),
        # per question (1 right, 0 wrong): pooled over seeds, and paired with GRPO's
        "correct_before": before["correct"],
        # the weights every method of the seed starts RL from, wherever they were made
        "warm_start_sha256": summary.get("warm_start", {}).get("weights_sha256"),
        "correct_after": after["correct"],
        "source": before["source"],
        # eval.samples: each question's share of right samples, before and after
        **(
            {
                "sampled_before": before["sampled"]["correct"],
                "sampled_after": after["sampled"]["correct"],
                "em_sampled_before": before["sampled"]["em"],
                "em_sampled_after": after["sampled"]["em"],
            }
            if "sampled" in before and "sampled" in after
            else {}
        ),
        "reward": [r.get("train/reward_mean", 0.0) for r in rows],
        "groups_all_wrong": [r.get("train/groups_all_wrong", math.nan) for r in rows],
        "groups_zero_advantage": [r.get("train/groups_zero_advantage", math.nan) for r in rows],
        "estimator_counters": {k: [r.get(k, math.nan) for r in rows] for k in counters},
        "rl_seconds": rl_seconds(rows),
    }


def rl_seconds(rows: list[dict]) -> float:
    """The training loop's wall time: its steps' seconds (``time/step_s``), without the
    warm-start and the evaluations around it."""
    return float(sum(r.get("time/step_s", 0.0) for r in rows))


def read_reports(paths: list[Path]) -> tuple[dict[tuple[str, int], dict], list[dict]]:
    """The runs of ``--report``'s records, by (method, seed), and the baseline's runs made
    from other starts. The first record is the study's; a later one adds the runs it lacks,
    typically a seed's methods made again from another machine's warm-start of that seed
    (the same settings on another CPU can give other weights). A later record's baseline
    run of a seed the study already has is another start's: kept apart (``others``), the
    baseline that its record's runs of that seed are paired with. Any other (method, seed)
    recorded twice is refused: a method's seed is one run of the study."""
    recorded: dict[tuple[str, int], dict] = {}
    origin: dict[tuple[str, int], Path] = {}
    others: list[dict] = []
    for path in paths:
        if not path.is_file():
            raise ValueError(f"--report {path}: no such study record (runs.jsonl)")
        try:
            runs = recorded_runs(path, None)
        except ValueError as err:
            raise ValueError(f"--report {path}: {err}") from None
        for (method, seed), run in runs.items():
            if (method, seed) not in recorded:
                recorded[method, seed], origin[method, seed] = run, path
            elif method == BASELINE:
                others.append({**run, "record": str(path)})
            else:
                raise ValueError(
                    f"--report {path} records {method} seed {seed}, as "
                    f"{origin[method, seed]} does: a method's seed is one run of the study; "
                    "give the records that hold it once"
                )
    return recorded, others


def paired_baseline(run: dict, baselines: list[dict]) -> dict | None:
    """The baseline's run that ``run`` is compared with: of its seed, the one that started
    where it did (:func:`different_start`), the first of them; None if none did."""
    for other in baselines:
        if other["seed"] == run["seed"] and different_start(run, [other]) is None:
            return other
    return None


def _baselines(report: dict) -> list[dict]:
    """Every run of the report's baseline: the study's, then those from other starts."""
    baseline = report.get("baseline")
    if not baseline:
        return []
    return [*report["runs"].get(baseline, []), *report.get("other_starts", [])]


def aggregate(runs: list[dict]) -> dict:
    """Across seeds: held-out EM after training (all questions) and its paired change
    from before (all questions and per data source), each the mean over seeds with a
    two-level bootstrap interval (seeds resampled, then each drawn seed's questions:
    :func:`ray_credit.stats.seeded_paired_difference`); EM before training and EM after
    per data source with a Student-t interval over the seeds' figures; how many seeds'
    own paired intervals exclude 0 either way; mean shares, searches and wall time. Runs
    recorded without per-question outcomes get a Student-t interval over the seeds'
    figures."""
    per_question = all("correct_after" in r for r in runs)
    sources = sorted({s for r in runs for s in r["em_after_by_source"]})
    changes = {part: pooled(runs, source=None if part == "all" else part)
               for part in ["all", *sources]}  # fmt: skip
    out = {
        "em_before": _interval([r["em_before"] for r in runs]),
        "em_after": _seeded_em(runs) if per_question else _interval([r["em_after"] for r in runs]),
        "em_change": (
            _as_stat(changes["all"])
            if changes["all"]
            else _interval([r["em_change"]["diff"] for r in runs])
        ),
        "seeds_with_significant_gain": sum(r["em_change"]["low"] > 0 for r in runs),
        "seeds_with_significant_loss": sum(r["em_change"]["high"] < 0 for r in runs),
    }
    out["em_after_by_source"] = {
        s: _interval([r["em_after_by_source"][s] for r in runs if s in r["em_after_by_source"]])
        for s in sources
    }
    out["em_change_by_source"] = {
        s: (
            _as_stat(changes[s])
            if changes[s]
            else _interval(
                [
                    r["em_change_by_source"][s]["diff"]
                    for r in runs
                    if s in r.get("em_change_by_source", {})
                ]
            )
        )
        for s in sources
        if changes[s] or any(s in r.get("em_change_by_source", {}) for r in runs)
    }
    for key in ("groups_all_wrong", "groups_zero_advantage"):
        values = [v for r in runs for v in r[key] if not math.isnan(v)]
        out[key] = mean(values) if values else None
    searches = [r["searches_after"] for r in runs if r.get("searches_after") is not None]
    out["searches_after"] = mean(searches) if searches else None
    out["searches_after_by_source"] = {
        s: mean(r["searches_after_by_source"][s] for r in runs)
        for s in sources
        if all(s in (r.get("searches_after_by_source") or {}) for r in runs)
    }
    out["em_change_pooled"] = changes
    walls = [r["seconds"] for r in runs if r.get("seconds") is not None]  # None: resumed
    out["seconds_per_run"] = mean(walls) if walls and len(walls) == len(runs) else None
    # the training loop alone: a seed's first method also makes the seed's warm-start and
    # its evaluation before training, which the others read back
    loops = [r["rl_seconds"] for r in runs if r.get("rl_seconds") is not None]
    out["rl_seconds_per_run"] = mean(loops) if len(loops) == len(runs) else None
    if runs and all("sampled_after" in r for r in runs):
        out["em_sampled_change_pooled"] = {
            part: pooled(runs, source=None if part == "all" else part, sampled=True)
            for part in ["all", *sources]
        }
    return out


def _seeded_em(runs: list[dict]) -> dict:
    """Held-out EM after training: the mean over seeds, its two-level interval, ``n`` the
    seeds (as :func:`_interval`'s)."""
    from ray_credit.stats import seeded_mean

    stat = seeded_mean({r["seed"]: r["correct_after"] for r in runs})
    return {"mean": stat["mean"], "low": stat["low"], "high": stat["high"], "n": len(runs),
            "questions": stat["n"]}  # fmt: skip


def _as_stat(change: dict) -> dict:
    """A pooled change as a mean with its interval (``n``: its seeds)."""
    return {"mean": change["diff"], "low": change["low"], "high": change["high"],
            "n": change["seeds"], "pairs": change["n"]}  # fmt: skip


def pooled(
    runs: list[dict],
    baseline: list[dict] | None = None,
    *,
    source: str | None = None,
    sampled: bool = False,
):
    """The paired change of held-out EM over the seeds (a pair per seed and question,
    ``source``'s questions only when given): the mean over seeds of each seed's paired
    change, with the two-level bootstrap interval of
    :func:`ray_credit.stats.seeded_paired_difference` (seeds resampled, then their
    questions; ``seeds`` says how many went in): EM after training minus before it, or,
    with ``baseline`` (another method's runs), minus the baseline's EM after training on
    the same seed, whose held-out questions and warm-start are the same. None where a run
    has no per-question outcomes (recorded before they were kept) or no seed is shared.
    ``sampled``: the same of the sampled EM (``eval.samples``: a question's score is its
    share of right samples). A question of a run that the baseline's same seed did not
    evaluate is refused, naming it."""
    from ray_credit.stats import seeded_paired_difference

    kind = "sampled" if sampled else "correct"
    by_seed = {r["seed"]: r for r in baseline or []}
    pairs = {}
    for run in runs:
        if f"{kind}_after" not in run:
            return None
        if baseline is None:
            reference = run[f"{kind}_before"]
        elif run["seed"] in by_seed and f"{kind}_after" in by_seed[run["seed"]]:
            reference = by_seed[run["seed"]][f"{kind}_after"]
        else:
            continue
        after = run[f"{kind}_after"]
        questions = [q for q in after if source is None or run["source"][q] == source]
        missing = [q for q in questions if q not in reference]
        if missing:
            raise ValueError(
                f"seed {run['seed']}: {len(missing)} of its {len(questions)} held-out questions "
                f"were not evaluated in the runs it is paired with (e.g. {missing[0]!r}): they "
                "held out other questions; compare runs made with the same data settings"
            )
        if questions:
            pairs[run["seed"]] = ({q: reference[q] for q in questions},
                                  {q: after[q] for q in questions})  # fmt: skip
    return seeded_paired_difference(pairs) if pairs else None


def _interval(values: list[float]) -> dict:
    """Mean, std and a 95 % Student-t interval of the mean (None where n < 2)."""
    n = len(values)
    m = mean(values)
    if n < 2:
        return {"mean": m, "std": None, "low": None, "high": None, "n": n}
    s = stdev(values)
    half = _t975(n - 1) * s / math.sqrt(n)
    return {"mean": m, "std": s, "low": m - half, "high": m + half, "n": n}


def _t975(dof: int) -> float:
    """Student t's 97.5 % quantile (a two-sided 95 % interval): tabulated to 30 degrees of
    freedom (a missing row takes the row below it: a wider interval), then
    1.96 + 2.4 / dof, within 0.002 of the true value from 30 on."""
    table = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365,
             8: 2.306, 9: 2.262, 10: 2.228, 15: 2.131, 20: 2.086, 30: 2.042}  # fmt: skip
    if dof >= 30:
        return 1.96 + 2.4 / dof
    return table[max(k for k in table if k <= dof)]


def table(report: dict) -> str:
    """The report as Markdown tables. Across seeds: EM after training and its paired change
    (all, then per data source), each with its two-level interval (:func:`aggregate`),
    seeds whose own paired interval excludes 0 either way, group shares, searches per
    question after training, wall time per run and the training loop's. Paired: the
    changes from before training and against the baseline (GRPO), with the questions that
    moved each way and the sign test on them. Then the shares per step."""
    methods = report["methods"]
    sources = sorted({s for agg in methods.values() for s in agg["em_change_by_source"]})
    head = ["method", "seeds", "EM before", "EM after [95% CI]", "change [95% CI]"]
    head += [f"{s} change" for s in sources]
    head += ["seeds +/-", "all-wrong", "zero-adv", "searches (" + " / ".join(sources) + ")"]
    head += ["s/run", "RL s/run"]
    rows = []
    for method, agg in methods.items():
        searches = agg.get("searches_after_by_source") or {}
        row = [
            method,
            str(agg["em_after"]["n"]),
            f"{agg['em_before']['mean']:.3f}",
            _with_ci(agg["em_after"], "{:.3f}"),
            _change_cell(agg, "all"),
            *(_change_cell(agg, s) if s in agg["em_change_by_source"] else "n/a" for s in sources),
            f"{agg['seeds_with_significant_gain']}/{agg['seeds_with_significant_loss']}",
            _fmt(agg["groups_all_wrong"], "{:.2f}"),
            _fmt(agg["groups_zero_advantage"], "{:.2f}"),
            " / ".join(_fmt(searches.get(s), "{:.2f}") for s in sources),
            _fmt(agg["seconds_per_run"], "{:.0f}"),
            _fmt(agg.get("rl_seconds_per_run"), "{:.0f}"),
        ]
        rows.append(row)
    lines = _markdown(head, rows)
    baseline = report.get("baseline")
    parts = ["all", *sources]
    head = ["method", *(f"{p} change" for p in parts)]
    if baseline:
        head += [f"{p}: after - {baseline}'s after" for p in parts]
    rows = []
    seeds = len(report.get("seeds") or [])
    for method, agg in methods.items():
        row = [method, *(_paired(agg["em_change_pooled"].get(p), seeds) for p in parts)]
        if baseline:
            versus = agg.get("vs_baseline") or {}
            row += [_paired(versus.get(p), seeds) if method != baseline else "-" for p in parts]
        rows.append(row)
    text = (
        lines + "\n\nPaired on the same held-out questions (the mean over seeds of each seed's "
        "change; 95 % interval of a bootstrap over the seeds, then their questions; questions "
        "better / worse and, on one seed, the exact sign test on them):\n\n" + _markdown(head, rows)
    )
    if report.get("other_starts"):
        study = {r["seed"]: r for r in report["runs"][baseline]}
        head = ["seed", "warm-start (SHA-256)", "runs paired with its baseline run",
                f"{baseline}'s EM before / after",
                *(f"{p}: {baseline} from it - {baseline} from the study's" for p in parts)]  # fmt: skip
        rows = []
        for alt in report["other_starts"]:
            ours = study[alt["seed"]]
            rows.append([
                str(alt["seed"]),
                f"{_digest(alt)} (the study's: {_digest(ours)})",
                ", ".join(m for m in alt["paired_with"] if m != baseline) or "-",
                f"{alt['em_before']:.3f} / {alt['em_after']:.3f} "
                f"({ours['em_before']:.3f} / {ours['em_after']:.3f})",
                *(_paired(alt["vs_study_start"].get(p), 1) for p in parts),
            ])  # fmt: skip
        text += (
            "\n\nSeeds with runs from another warm-start (the same settings made again "
            f"elsewhere): each of those runs is compared with {baseline}'s run from that "
            f"warm-start, the rest with {baseline}'s from the study's; {baseline} from the "
            "two starts, paired on the seed's questions, is what the start alone moved:\n\n"
            + _markdown(head, rows)
        )
    steps = max((len(r["groups_all_wrong"]) for rs in report["runs"].values() for r in rs),
                default=0)  # fmt: skip
    if steps:
        rows = []
        for method, runs in report["runs"].items():
            wrong = per_step_mean(runs, "groups_all_wrong")
            zero = per_step_mean(runs, "groups_zero_advantage")
            cells = [f"{_fmt(_at(wrong, i), '{:.2f}')} / {_fmt(_at(zero, i), '{:.2f}')}"
                     for i in range(steps)]  # fmt: skip
            rows.append([method, *cells])
        head = ["method", *(f"step {i + 1}" for i in range(steps))]
        text += (
            "\n\nPer step, the share of groups whose trajectories are all wrong / the share "
            "whose advantages are all zero (mean over the seeds):\n\n" + _markdown(head, rows)
        )
    sampled = {m: agg["em_sampled_change_pooled"] for m, agg in methods.items()
               if "em_sampled_change_pooled" in agg}  # fmt: skip
    if sampled:
        head = ["method", *(f"{p} sampled EM change" for p in parts)]
        rows = [
            [m, *(_paired(changes.get(p), seeds) for p in parts)] for m, changes in sampled.items()
        ]
        text += (
            "\n\nSampled EM (eval.samples rollouts per question; a question scores its share "
            "of right samples), pooled the same way (questions whose share rose / fell):\n\n"
            + _markdown(head, rows)
        )
    against = report.get("against")
    if against:
        theirs = " ".join(against["settings"]) or "the embedded settings"
        other = against.get("method")
        head = ["method", *(f"{p}: after - after with {theirs}" for p in parts)]
        rows = [
            [m, *(_paired((agg.get("vs_against") or {}).get(p), seeds) for p in parts)]
            for m, agg in methods.items()
        ]
        whose = f"its {other} runs" if other else "the same method"
        starts = against.get("warm_start") or {}
        said = [
            f"{words} on seed{'s' if len(starts[kind]) > 1 else ''} {_seeds(starts[kind])}"
            for kind, words in (
                ("same", "from the same warm-start"),
                ("other", "from other warm-starts (the difference includes theirs)"),
                ("unknown", "from warm-starts not recorded"),
            )
            if starts.get(kind)
        ]
        text += (
            f"\n\nAgainst {against['record']} ({whose} and seeds with {theirs}; "
            "paired on the same questions"
            + (f"; started {'; '.join(said)}" if said else "")
            + "):\n\n"
            + _markdown(head, rows)
        )
    return text


def _digest(run: dict) -> str:
    """A run's warm-start by the first 12 hex digits of its weights' SHA-256."""
    digest = run.get("warm_start_sha256")
    return f"{digest[:12]}..." if digest else "not recorded"


def per_step_mean(runs: list[dict], key: str) -> list[float | None]:
    """A per-step series of the runs (one per seed), averaged over the seeds that have a
    value at that step (None where none has)."""
    steps = max((len(r[key]) for r in runs), default=0)
    out = []
    for i in range(steps):
        values = [r[key][i] for r in runs if i < len(r[key]) and not math.isnan(r[key][i])]
        out.append(mean(values) if values else None)
    return out


def _at(series: list, i: int):
    return series[i] if i < len(series) else None


def _markdown(head: list[str], rows: list[list[str]]) -> str:
    """A Markdown table: the header, its rule and one line per row."""
    lines = ["| " + " | ".join(cells) + " |" for cells in (head, *rows)]
    return "\n".join([lines[0], "|" + "---|" * len(head), *lines[1:]])


def _paired(change: dict | None, seeds: int = 0) -> str:
    """A paired change as a cell: the change, its interval, the questions that moved each
    way (and, on one seed, the sign test's p); the seeds it rests on when fewer than the
    study's."""
    if change is None:
        return "n/a"
    fewer = f", {change['seeds']} of {seeds} seeds" if change.get("seeds", seeds) < seeds else ""
    if change["better"] + change["worse"] == 0:
        return f"no question changed (n={change['n']}{fewer})"
    # the sign test reads the questions as the only randomness: on one seed's questions
    # it says what the bootstrap cannot when few moved; over seeds, it would treat the
    # seeds' runs as one, as a pooled bootstrap would
    p = change.get("p_sign") if change.get("seeds", 1) == 1 else None
    sign = "" if p is None else (", p<0.001" if p < 0.001 else f", p={p:.3f}")
    return (
        f"{change['diff']:+.3f} [{change['low']:+.3f}, {change['high']:+.3f}] "
        f"({change['better']}/{change['worse']}{sign}{fewer})"
    )


def _change_cell(agg: dict, part: str) -> str:
    """The change across seeds on all questions (``part="all"``) or a data source's, or
    that none of those questions changed."""
    moved = (agg.get("em_change_pooled") or {}).get(part)
    if moved is not None and moved["better"] + moved["worse"] == 0:
        return "no question changed"
    return _with_ci(agg["em_change"] if part == "all" else agg["em_change_by_source"][part],
                    "{:+.3f}")  # fmt: skip


def _with_ci(stat: dict, fmt: str) -> str:
    if stat["low"] is None:
        return fmt.format(stat["mean"])
    return f"{fmt.format(stat['mean'])} [{fmt.format(stat['low'])}, {fmt.format(stat['high'])}]"


def _fmt(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else fmt.format(value)


def plot_curves(report: dict, path: Path) -> None:
    """Top: training reward per step (mean over seeds, band: one std), and the shares of
    all-wrong and of zero-advantage groups per step (mean over seeds); each method keeps
    its own marker, so methods that coincide stay visible. Bottom left: each method's
    paired change of held-out EM from before training, all questions and per data source.
    Bottom right: its EM after training minus the baseline's (GRPO's) on the same seeds and
    questions. Each of the two: every seed's figure (dots) and the mean over seeds with its
    95 % interval (:func:`aggregate`'s and :func:`pooled`'s: seeds resampled, then their
    questions)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplot_mosaic(
        [["reward"] * 2 + ["wrong"] * 2 + ["zero"] * 2, ["change"] * 3 + ["versus"] * 3],
        figsize=(18, 10),
    )
    markers = "osD^vP*X<>"
    for i, (method, runs) in enumerate(report["runs"].items()):
        style = {"color": f"C{i}", "marker": markers[i % len(markers)], "markersize": 5,
                 "label": f"{method} (n={len(runs)})"}  # fmt: skip
        for key in ("groups_all_wrong", "groups_zero_advantage"):
            series = per_step_mean(runs, key)
            axes["wrong" if key == "groups_all_wrong" else "zero"].plot(
                [s + 1 for s, v in enumerate(series) if v is not None],
                [v for v in series if v is not None], alpha=0.8, **style,
            )  # fmt: skip
        length = min(len(r["reward"]) for r in runs)
        curves = np.array([r["reward"][:length] for r in runs])
        steps = np.arange(1, length + 1)
        centre = curves.mean(axis=0)
        axes["reward"].plot(steps, centre, alpha=0.8, **style)
        if len(runs) > 1:
            spread = curves.std(axis=0, ddof=1)
            axes["reward"].fill_between(steps, centre - spread, centre + spread,
                                        color=f"C{i}", alpha=0.12)  # fmt: skip
    axes["reward"].set_ylabel("training reward (mean over seeds, band: 1 std)")
    for key, what in (("wrong", "all wrong"), ("zero", "with all advantages zero")):
        axes[key].set_ylabel(f"share of groups {what} (mean over seeds)")
        axes[key].set_ylim(-0.02, 1.02)
    for key in ("reward", "wrong", "zero"):
        axes[key].set_xlabel("step")
        axes[key].legend(fontsize=8)
        axes[key].grid(alpha=0.3)

    sources = sorted(
        {s for runs in report["runs"].values() for r in runs for s in r["em_change_by_source"]}
    )
    parts = ["all", *sources]
    _change_panel(axes["change"], report, parts, baseline=None)
    axes["change"].set_ylabel("held-out EM after - before (paired)")
    baseline = report.get("baseline")
    if baseline:
        _change_panel(axes["versus"], report, parts, baseline=baseline)
        axes["versus"].set_ylabel(f"held-out EM after - {baseline}'s after (paired)")
    else:
        axes["versus"].set_axis_off()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _change_panel(axis, report: dict, parts: list[str], baseline: str | None) -> None:
    """Per method and part (all questions, then each data source): every seed's paired
    change (dots) and the mean over seeds with its 95 % interval. The change from before
    training, or with ``baseline``, EM after training minus the baseline's run of the
    same seed and warm-start (:func:`paired_baseline`; the baseline itself left out)."""
    methods = [m for m in report["runs"] if m != baseline]
    if not methods:  # the baseline alone: nothing to draw against it
        axis.set_axis_off()
        return
    baselines = _baselines(report)
    width, labelled = 0.8 / len(parts), set()
    for j, part in enumerate(parts):
        for i, name in enumerate(methods):
            changes = []
            for run in report["runs"][name]:
                if baseline is None:
                    moved = (
                        run["em_change"] if part == "all" else run["em_change_by_source"].get(part)
                    )
                    value = None if moved is None else moved["diff"]
                else:
                    theirs = _em_after(paired_baseline(run, baselines), part)
                    ours = _em_after(run, part)
                    value = None if ours is None or theirs is None else ours - theirs
                if value is not None:
                    changes.append(value)
            agg = report["methods"][name]
            if baseline is None:
                stat = agg["em_change"] if part == "all" else agg["em_change_by_source"].get(part)
            else:
                pooled_change = (agg.get("vs_baseline") or {}).get(part)
                stat = None if pooled_change is None else _as_stat(pooled_change)
            if not changes and stat is None:
                continue
            x = i + (j - (len(parts) - 1) / 2) * width
            axis.scatter([x] * len(changes), changes, s=10, color=f"C{j}", alpha=0.5)
            if stat is not None:
                error = (
                    None
                    if stat["low"] is None
                    else [[stat["mean"] - stat["low"]], [stat["high"] - stat["mean"]]]
                )
                axis.errorbar(x, stat["mean"], yerr=error, fmt="o", color=f"C{j}", capsize=3,
                              label=None if part in labelled else part)  # fmt: skip
                labelled.add(part)
    axis.axhline(0, color="black", linewidth=0.8)
    axis.set_xticks(range(len(methods)), methods, fontsize=8)
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3, axis="y")


def _em_after(run: dict | None, part: str) -> float | None:
    """A run's held-out EM after training on all questions or a data source's (None
    without the run or the source)."""
    if run is None:
        return None
    return run["em_after"] if part == "all" else run["em_after_by_source"].get(part)


if __name__ == "__main__":
    raise SystemExit(main())
