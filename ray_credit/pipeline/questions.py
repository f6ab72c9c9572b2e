"""The run's questions: which are trained on and which are held out, and Search-P1's
reference plans for the training questions."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from ray_credit.log import log
from ray_credit.pipeline.configs import DataConfig
from ray_credit.pipeline.plan import Plan

__all__ = ["judge_identity", "load_data", "load_questions", "with_reference_plans"]


def load_data(data: DataConfig, *, seed: int) -> tuple[Any, list[dict], list[dict]]:
    """(corpus, training questions, evaluation questions); ``seed`` (the pipeline's)
    decides which questions are held out."""
    from ray_credit.config import InputError

    corpus, questions = load_questions(data)
    if data.eval_file is not None:
        from ray_credit.data.loaders import load_qa

        return corpus, questions, _with_prompts(load_qa(data.eval_file), data, data.eval_file)
    if not 0 < data.eval_questions < len(questions):
        raise InputError(
            f"data.eval_questions={data.eval_questions} must hold out at least one of the "
            f"{len(questions)} questions and leave at least one to train on"
        )
    order = np.random.default_rng(seed + 7919).permutation(len(questions))
    held = set(order[: data.eval_questions].tolist())
    train_q = [q for i, q in enumerate(questions) if i not in held]
    eval_q = [questions[i] for i in sorted(held)]
    return corpus, train_q, eval_q


def load_questions(data: DataConfig) -> tuple[Any, list[dict]]:
    """(corpus, every question of ``data.questions``), nothing held out."""
    from ray_credit.config import InputError

    if data.questions == "synthetic":
        from ray_credit.data import make_world

        world = make_world(data.world)
        corpus, questions = world.corpus, list(world.questions)
    else:
        from ray_credit.data.loaders import load_qa

        if data.corpus is None:
            raise InputError(
                f"data.questions={data.questions!r} needs data.corpus (FlashRAG jsonl)"
            )
        if not Path(data.corpus).is_file():
            raise InputError(
                f"data.corpus {data.corpus!r} does not exist (or is not a file); give a "
                "FlashRAG jsonl corpus the driver can read"
            )
        corpus, questions = (
            data.corpus,
            _with_prompts(load_qa(data.questions), data, data.questions),
        )
    return corpus, questions


def _with_prompts(questions: list[dict], data: DataConfig, path: str) -> list[dict]:
    """The questions with the prompt ``data.prompts`` picks: the file's own (and a note
    that says so), or none (the generator's template renders every one)."""
    own = sum(q.get("prompt") is not None for q in questions)
    if not own:
        return questions
    if data.prompts == "template":
        log.info(f"note: {path}: its 'prompt' column is not used (data.prompts=template): "
                 "generator.prompt_template renders every question")  # fmt: skip
        return [{**q, "prompt": None} for q in questions]
    others = len(questions) - own
    log.info(
        f"note: {path}: {own} of {len(questions)} questions bring their own prompt (the "
        "'prompt' column), used as given"
        + (f"; generator.prompt_template renders the other {others}" if others else "")
        + "; --data.prompts template renders generator.prompt_template for every question"
    )
    return questions


def judge_identity(judge: Any) -> str:
    """What makes a judge's reference plans its own (a JudgeConfig's backend, model, its
    endpoint for an OpenAI-compatible one, and guided decoding as it applies: unset is on
    for hf, off for openai): plans another judge made are not reused."""
    guided = judge.guided if judge.guided is not None else judge.backend == "hf"
    made_by = {"backend": judge.backend, "model": judge.model, "guided": guided}
    if judge.backend == "openai":
        made_by["base_url"] = judge.base_url
    return json.dumps(made_by)


def with_reference_plans(
    plan: Plan, judges: Any, questions: list[dict], cache: Path, made_by: str
) -> list[dict]:
    """The questions with Search-P1's reference plans: the question file's, else those
    cached by the same judge (``cache``, JSON lines, each with the ``made_by`` of
    :func:`judge_identity`), else made now by the judge pool and cached. A plan the judge
    failed to make is not cached (the next run asks again); its question's trajectories
    go unjudged, counted in ``judge/no_evidence``."""
    if not plan.question_signals:
        return questions
    (signal,) = plan.question_signals
    known, others = _cached_plans(cache, made_by)
    todo = [q for q in questions if not q.get("reference_plan") and q["question"] not in known]
    again = sum(q["question"] in others for q in todo)
    if again:
        log.info(f"note: {again} reference plans in {cache} were made by another judge (or "
                 f"before the file named its judge), not {made_by}: made again")  # fmt: skip
    if todo:
        t0 = time.perf_counter()
        made = judges.judge(signal, todo)
        with cache.open("a", encoding="utf-8") as out:
            for q, value in zip(todo, made, strict=True):
                if value is not None:
                    known[q["question"]] = value["reference_plan"]
                    row = {"question": q["question"], "reference_plan": value["reference_plan"],
                           "judge": made_by}  # fmt: skip
                    out.write(json.dumps(row) + "\n")
        log.info(
            f"reference plans: {sum(v is not None for v in made)} made of {len(todo)} "
            f"({time.perf_counter() - t0:.0f}s), kept in {cache}",
        )
    out_q = [
        q if q.get("reference_plan") else {**q, "reference_plan": known.get(q["question"])}
        for q in questions
    ]
    missing = sum(not q["reference_plan"] for q in out_q)
    if missing:
        log.warning(
            f"warning: {missing} of {len(out_q)} training questions have no reference plan "
            "(the judge failed to make one); their trajectories go unjudged, counted in "
            "judge/no_evidence",
        )
    return out_q


def _cached_plans(cache: Path, made_by: str) -> tuple[dict[str, list[str]], set[str]]:
    """The reference plans kept in ``cache`` by the judge ``made_by``, by question, and
    the questions whose plans there are only another judge's (or were kept before the
    cache named its judge; the lines of every judge stay in the file). A last line cut
    off by a run killed while writing it is removed (its plan is made again), so that the
    next line appended starts on a line of its own; any other unreadable line is refused,
    named."""
    from ray_credit.config import InputError

    if not cache.is_file():
        return {}, set()
    text = cache.read_text(encoding="utf-8")
    if text and not text.endswith("\n"):  # the next line appended must start a line
        kept, newline, last = text.rpartition("\n")
        try:
            json.loads(last)
            text += "\n"  # whole, only its newline missing
        except json.JSONDecodeError:
            log.info(f"note: {cache}'s last line was cut off ({len(last)} characters, a run "
                     "killed while writing it): removed, its plan is made again")  # fmt: skip
            text = kept + newline
        partial = cache.with_name(cache.name + ".partial")
        partial.write_text(text, encoding="utf-8")
        partial.replace(cache)  # whole or as it was: a kill here loses no plan
    known: dict[str, list[str]] = {}
    others = set()
    for number, line in enumerate(text.splitlines(), 1):
        try:
            row = json.loads(line)
            if row.get("judge") == made_by:
                known[row["question"]] = row["reference_plan"]
            else:
                others.add(row["question"])
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise InputError(
                f"{cache}:{number}: not a reference plan ({line[:80]!r}); delete the file "
                "to have the judge make the plans again"
            ) from None
    return known, others - known.keys()
