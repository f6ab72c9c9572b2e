"""Exact match of any policy (a training checkpoint, an HF id or folder) on a question set,
overall and per data source: one greedy rollout per question against the retriever.

    python pipelines/eval.py --model runs/tspo/checkpoint      # the held-out synthetic questions
    python pipelines/eval.py --config pipelines/configs/search_r1.yaml \\
        --model Qwen/Qwen2.5-3B-Instruct --data.questions test.parquet --data.corpus wiki-18.jsonl.gz
    ray job submit --working-dir . -- python pipelines/eval.py --model /shared/ckpt

Its data, retriever, generator and resources settings come from --config (the same YAML
file as the training pipelines'); without one, from the run that made a training
checkpoint (its run config, kept in the checkpoint); else from the package's
embedded.yaml, the CPU demo's, with which a question file is refused (MiniLM, 32-token
turns, top-1). It says which. So it holds out and prompts exactly as the training run did (a question file of its own, a test set, is
evaluated whole: every question, in file order; so is data.eval_file, the evaluation file a
training run given one evaluates); the file's training sections (learner, pipeline, ...) do
not apply here and are skipped. A checkpoint's held-out questions are those its run held
out: --seed and the data settings that pick them must be its run's. Rollouts are greedy
with one sample per question, whatever generator.temperature and generator.group_size say;
with --samples K, each question is also rolled out K times at generator.temperature and
top_p, and scores its share of right samples (the sampled EM, as a training run's
eval.samples measures it). Its retriever and generators are placed before any starts, as a
training run's are.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

from ray_credit.actors.generator import GeneratorConfig
from ray_credit.config import InputError, check_fields
from ray_credit.estimators import ESTIMATORS  # noqa: E402
from ray_credit.log import LogLevel, setup_logging
from ray_credit.pipeline import checkpoints
from ray_credit.pipeline.configs import (
    EMBEDDED_CONFIG,
    DataConfig,
    ResourcesConfig,
    RetrieverConfig,
    check_resource_use,
)
from ray_credit.pipeline.evaluation import (
    describe_change,
    eval_change,
    evaluate_on,
    overrides_of,
    sampled_title,
)
from ray_credit.pipeline.placement import EVALUATION, evaluation_asks, held_in
from ray_credit.pipeline.preflight import (
    check_cluster_config,
    check_index_settings,
    check_model,
    check_retrieval,
)
from ray_credit.pipeline.questions import load_data, load_questions
from ray_credit.pipeline.services import (
    connect,
    make_generators,
    make_retriever,
    reserve_slice_bundles,
)
from ray_credit.signals import SIGNALS  # noqa: E402

# What a training run's YAML file may hold that evaluation does not use.
TRAINING_SECTIONS = (
    *("name", "output_dir", "resume", "wandb", "learner", "pipeline", "eval", "judge"),
    *("storage_path", "warm_start", "estimator"),
    *ESTIMATORS,
    *SIGNALS,
)


@dataclass(frozen=True)
class EvalRun:
    model: str = "smollm2-135m"
    """A checkpoint folder (runs/NAME/checkpoint), an HF id or folder, or an embedded name."""
    split: Literal["heldout", "all", "eval_file"] | None = None
    """'heldout' (the questions a training run with the same data settings and seed holds
    out), 'all' (every question of data.questions, in file order: a test set's) or
    'eval_file' (every question of data.eval_file, as a training run given one evaluates).
    None: 'eval_file' when data.eval_file is given; else 'heldout' where a training split
    applies (the synthetic questions, or the question file the checkpoint's run trained
    on), else 'all'."""
    output: str | None = None
    """Write the results here as JSON (None: print only)."""
    before: str | None = None
    """An earlier evaluation of the same questions to compare with: this script's
    --output JSON, or a training run's summary.json (its eval_before). The change is
    printed with its paired 95 % interval, overall and per data source, and kept."""
    data: DataConfig = field(default_factory=DataConfig)
    retriever: RetrieverConfig = field(default_factory=RetrieverConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    timeout_s: float = 3600.0
    """Longest wait for one generator's share of the questions."""
    seed: int = 0
    """The training run's pipeline.seed (it decides which questions are held out)."""
    samples: int = 0
    """Also roll out every question this many times at the generator's sampling settings
    (temperature, top_p, seed) and report the sampled EM: each question scores its share
    of right samples; with --before, paired with its sampled evaluation when it has one.
    It costs about this many times the greedy evaluation. 0: greedy only."""
    log_level: LogLevel = "info"
    """What it prints: 'info', 'warning', 'error' or 'debug' (the libraries' logs too)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.samples < 0:
            raise ValueError(f"samples must be >= 0 (0: greedy only), got {self.samples}")
        if not 0 < self.timeout_s < math.inf:
            raise ValueError(
                f"timeout_s must be a finite number of seconds > 0, got {self.timeout_s}"
            )

    def check(self) -> None:
        """Checks across sections: resources an actor would hold and never use."""
        check_resource_use(self.resources, self.generator, self.retriever)


def choose_split(cfg: EvalRun, model_path: str) -> tuple[str, str]:
    """(the split, why): with data.eval_file, 'eval_file' (a training run given one holds
    nothing out of data.questions and evaluates the eval file; another ``--split`` is
    refused, since the eval file would go unevaluated); else ``cfg.split`` when given;
    else 'heldout' for the synthetic questions or for the question file the checkpoint's
    training run held questions out of, 'all' for any other question file (a test set:
    nothing of it was trained on here). A held-out split of the checkpoint's own questions
    is refused when this evaluation's seed or data settings would hold out others than
    its run did (:func:`check_heldout`)."""
    eval_file = cfg.data.eval_file
    if eval_file is not None and cfg.split not in (None, "eval_file"):
        also = "every question of data.questions"
        if cfg.split == "heldout":
            also = "questions held out of data.questions (a run given an eval file holds none out)"
        raise InputError(
            f"--split {cfg.split} evaluates {also}, and data.eval_file={eval_file!r} would go "
            "unevaluated; drop --split to evaluate the eval file, or drop the eval file "
            "(--data.eval_file none)"
        )
    if eval_file is not None:
        return "eval_file", "data.eval_file"
    if cfg.split == "eval_file":
        raise InputError("--split eval_file needs the file: --data.eval_file FILE")
    run = _trained_run(model_path)
    trained_on = (run or {}).get("data", {}).get("questions")
    same = trained_on is not None and (
        trained_on == cfg.data.questions == "synthetic"
        or Path(trained_on).resolve() == Path(cfg.data.questions).resolve()
    )
    split, why = cfg.split, "--split"
    if split is None and cfg.data.questions == "synthetic":
        split, why = "heldout", "the synthetic questions' training split"
    elif split is None and same:
        split, why = "heldout", f"the checkpoint's run trained on {trained_on}"
    elif split is None:
        split, why = "all", "no training run's split applies to it"
    if split == "heldout" and same:
        check_heldout(cfg, model_path, run)
    return split, why


def check_heldout(cfg: EvalRun, model_path: str, run: dict) -> None:
    """Refuse a held-out split of the questions the checkpoint's run trained on that is
    not the one that run held out: another seed or number of held-out questions, other
    world settings (each picks other questions, some of them trained on), or a run that
    held none out (it was given an eval file)."""
    data, seed = run.get("data") or {}, (run.get("pipeline") or {}).get("seed")
    where = f"--model {model_path}: its run"
    if data.get("eval_file") is not None:
        raise InputError(
            f"{where} trained on every question of {data.get('questions')} and evaluated "
            f"data.eval_file {data['eval_file']}, so none is held out; evaluate that file "
            f"(--data.eval_file {data['eval_file']}), or a test set (--split all)"
        )
    if seed is not None and seed != cfg.seed:
        raise InputError(
            f"{where} held out questions with pipeline.seed={seed}; eval.py's --seed "
            f"{cfg.seed} holds out others, some of them trained on: pass --seed {seed}"
        )
    held = data.get("eval_questions")
    if held is not None and held != cfg.data.eval_questions:
        raise InputError(
            f"{where} held out data.eval_questions={held}; {cfg.data.eval_questions} here "
            f"picks others, some of them trained on: pass --data.eval_questions {held} (or "
            "the run's --config)"
        )
    world = data.get("world")
    if cfg.data.questions == "synthetic" and isinstance(world, dict):
        mine = asdict(cfg.data.world)
        differ = sorted(k for k in world if world[k] != mine.get(k))  # those it kept
        if differ:
            theirs = ", ".join(f"--data.world.{k} {world.get(k)}" for k in differ)
            raise InputError(
                f"{where} trained on another synthetic world (it differs in "
                f"{', '.join(differ)}), whose held-out questions these are not: pass {theirs} "
                "(or the run's --config)"
            )


def _trained_run(path: str) -> dict | None:
    """The run config of the training run whose checkpoint ``path`` is (None: not a
    training checkpoint, or one that keeps no run config)."""
    saved = checkpoints(Path(path))
    if not saved:
        return None
    from ray_credit.pipeline.runner import checkpoint_state

    try:
        run = checkpoint_state(str(saved[-1][1]))["metadata"].get("run_config")
    except (OSError, ValueError, KeyError):
        return None
    return run if isinstance(run, dict) else None


def describe(cfg: EvalRun, split: str, why: str, count: int) -> str:
    """The line that says what is evaluated: which file, how many questions, and why."""
    head = f"evaluating {count} questions: split {split},"
    if split == "eval_file":
        return f"{head} every question of data.eval_file {cfg.data.eval_file}"
    if split == "all":
        return f"{head} every question of data.questions {cfg.data.questions} ({why})"
    return (
        f"{head} those held out of data.questions {cfg.data.questions} by --seed {cfg.seed} "
        f"(data.eval_questions {cfg.data.eval_questions}; {why})"
    )


def resolve_model(path: str) -> str:
    """A training checkpoint holds the policy under learner/model (a run's checkpoint
    folder: in its newest step's folder)."""
    folder = Path(path)
    saved = checkpoints(folder)
    if saved:
        folder = saved[-1][1]
    for candidate in (folder / "learner" / "model", folder / "model"):
        if (candidate / "config.json").is_file():
            return str(candidate)
    return path


def read_before(path: str) -> dict:
    """The per-question outcomes of an earlier evaluation: an --output file of this
    script, or a training run's summary.json (its eval_before)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SystemExit(f"--before {path}: cannot read it as JSON ({err})") from None
    data = data.get("eval_before", data) if isinstance(data, dict) else data
    if (
        not isinstance(data, dict)
        or not {"correct", "source", "em"} <= set(data)
        or not isinstance(data["correct"], dict)
        or not data["correct"]
    ):
        raise SystemExit(
            f"--before {path}: holds no per-question outcomes ('correct', 'source'); give "
            "an eval.py --output file or a run's summary.json"
        )
    return data


RUN_SECTIONS = ("data", "retriever", "generator", "resources")
"""What eval.py takes from a checkpoint's run when no --config is given."""

DEMO_SETTINGS = {  # the embedded CPU demo's settings that are wrong for real data
    "retriever.encoder.name": "minilm",
    "generator.max_new_tokens": 32,
    "generator.topk": 1,
    "generator.final_turn_prefix": "<answer>",
    "generator.response_prefix": "<search>",
    "generator.max_context_tokens": 2048,
}


def settings_source(argv: list[str]) -> tuple[Path | None, str, dict | None]:
    """Where eval.py's settings come from: ``(YAML file, what it is, the checkpoint's run
    config)``. --config FILE when given; else the run config a training checkpoint keeps
    (its data, retriever, generator and resources sections, so that it is evaluated with
    the encoder, index and rollout limits it trained with); else the embedded demo's."""
    import argparse

    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--config", type=Path)
    first.add_argument("--model", default=EvalRun.model)
    known, _ = first.parse_known_args(argv)
    if known.config is not None:
        return known.config, f"--config {known.config}", None
    run = _trained_run(known.model)
    if run is None or not all(isinstance(run.get(k), dict) for k in RUN_SECTIONS):
        return (
            Path(EMBEDDED_CONFIG),
            "the embedded CPU demo's (ray_credit/configs/embedded.yaml)",
            None,
        )
    return None, f"the run's that made the checkpoint {known.model}", run


def _run_yaml(run: dict, argv: list[str], folder: Path) -> Path:
    """The checkpoint's run settings as a YAML file parse_config reads like --config.
    The run's eval file is left out when a question file is given on the command line
    (that file is the one to evaluate)."""
    import yaml

    settings = {k: run[k] for k in RUN_SECTIONS}
    settings["seed"] = (run.get("pipeline") or {}).get("seed", 0)
    given = {a.split("=")[0] for a in argv}
    if "--data.questions" in given and "--data.eval_file" not in given:
        settings["data"] = {**settings["data"], "eval_file": None}
    path = folder / "run_settings.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path


def check_demo_settings(cfg: EvalRun) -> None:
    """A question file evaluated with the embedded demo's retrieval and rollout limits
    (MiniLM, 32-token turns, top-1, forced prefixes) is refused: they fit the synthetic
    world, and on a real corpus they would build a MiniLM index over it and cut every
    answer short."""
    from ray_credit.pipeline.published import get_path

    if cfg.data.questions == "synthetic":
        return
    used = {k: v for k, v in DEMO_SETTINGS.items() if get_path(cfg, k) == v}
    if used:
        spelled = ", ".join(f"{k} {v!r}" for k, v in used.items())
        raise InputError(
            f"data.questions {cfg.data.questions} is evaluated with the embedded CPU demo's "
            f"settings ({spelled}), made for the synthetic world; give the settings of the "
            "run that trained the policy: --config pipelines/configs/search_r1.yaml (or your "
            "run's YAML), a training checkpoint (its run's settings are taken), or each "
            "flag (--retriever.encoder.name e5-base-v2 --generator.max_new_tokens 500 ...)"
        )


def main(argv=None) -> dict:
    import sys
    import tempfile

    from ray_credit.config import parse_config

    argv = list(sys.argv[1:] if argv is None else argv)
    config, source, run = settings_source(argv)
    with tempfile.TemporaryDirectory() as folder:
        if run is not None:
            config = _run_yaml(run, argv, Path(folder))
        cfg = parse_config(
            EvalRun,
            argv,
            description=__doc__,
            default_config=config,
            skip_sections=TRAINING_SECTIONS,
        )
    setup_logging(cfg.log_level)
    print(f"settings: {source}; flags override them", flush=True)
    greedy = replace(cfg.generator, temperature=0.0, group_size=1)
    # everything a user handed us is checked before Ray starts, and refused in one line
    earlier = read_before(cfg.before) if cfg.before else None
    if cfg.output and not Path(cfg.output).resolve().parent.is_dir():
        raise SystemExit(f"eval.py: error: --output {cfg.output}: its folder does not exist")
    model = resolve_model(cfg.model)
    try:
        split, why = choose_split(cfg, cfg.model)
        cfg = replace(cfg, split=split)
        if split == "all":  # every question of the file: no split to hold out
            corpus, questions = load_questions(cfg.data)
        else:  # the held-out questions, or with data.eval_file every question of it
            corpus, _, questions = load_data(cfg.data, seed=cfg.seed)
        check_model("--model", model)
        if config == Path(EMBEDDED_CONFIG):  # neither --config nor a checkpoint's run
            check_demo_settings(cfg)
        check_retrieval(cfg)  # the encoder, the corpus's first document, a server's URL
        check_index_settings(cfg, corpus)  # and an index folder the settings did not make
        check_cluster_config(cfg)
        asks = evaluation_asks(cfg)
    except InputError as err:
        raise SystemExit(f"eval.py: error: {err}") from None
    print(describe(cfg, split, why, len(questions)), flush=True)
    try:  # placed before any actor starts (a local Ray's plan before Ray itself)
        ray = connect(cfg, held_in(asks, EVALUATION), asks=asks)
    except InputError as err:
        raise SystemExit(f"eval.py: error: {err}") from None
    index = cfg.retriever.index_folder
    slices = reserve_slice_bundles(cfg, learners=False)  # the index beside the generators
    retriever = make_retriever(corpus, cfg.retriever, cfg.resources, index, slices)
    # resources.num_generators generators, for this evaluation only: greedy, then sampled
    generators = make_generators(model, retriever, cfg, greedy, prefix="eval", slices=slices)
    result = {
        "model": model,
        "split": cfg.split,
        **evaluate_on(generators, questions, cfg.timeout_s, **overrides_of(greedy)),
        "config": asdict(cfg),
    }
    if cfg.samples:
        sampled = replace(greedy, temperature=cfg.generator.temperature, group_size=cfg.samples)
        result["sampled"] = evaluate_on(
            generators, questions, cfg.timeout_s, **overrides_of(sampled)
        )
    for generator in generators:
        ray.kill(generator)
    if slices is not None:
        slices.remove()
    print(f"{'data source':<24} {'n':>6} {'EM':>7}")
    for name, em in result["em_by_source"].items():
        print(f"{name:<24} {result['count_by_source'][name]:>6} {em:>7.3f}")
    print(f"{'all':<24} {result['questions']:>6} {result['em']:>7.3f}")
    if cfg.samples:
        print(f"{'sampled EM':<24} {result['questions']:>6} {result['sampled']['em']:>7.3f}"
              f"  ({cfg.samples} samples per question at temperature "
              f"{cfg.generator.temperature:g})")  # fmt: skip
    if earlier is not None:
        result["change"] = eval_change(earlier, result)
        print(describe_change(earlier, result, result["change"]), flush=True)
        if cfg.samples and "sampled" in earlier:
            b, a = earlier["sampled"], result["sampled"]
            result["change_sampled"] = eval_change(b, a)
            print(describe_change(b, a, result["change_sampled"], sampled_title(b, a)), flush=True)
        elif cfg.samples:
            print(f"--before {cfg.before} has no sampled evaluation: the sampled EM is not "
                  "paired (a run's eval.samples, or this script's --samples, makes one)")  # fmt: skip
    if cfg.output:
        Path(cfg.output).write_text(json.dumps(result, indent=2))
        print(f"wrote {cfg.output}")
    return result


if __name__ == "__main__":
    main()
