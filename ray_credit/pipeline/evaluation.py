"""Held-out exact match: a greedy (and, with ``eval.samples``, a sampled) rollout of every
held-out question by a generator on the policy's current weights, summarized where the
batch is, and the paired change between two evaluations of the same questions with its
95 % bootstrap interval (:func:`ray_credit.stats.paired_difference`), overall and per
data source.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from ray_credit.actors import actor_lost_errors
from ray_credit.log import log
from ray_credit.pipeline.services import make_generators
from ray_credit.warm_start import settings_fingerprint

__all__ = [
    "describe_change",
    "eval_change",
    "eval_metrics",
    "eval_summary",
    "evaluate",
    "evaluate_on",
    "evaluate_policy",
    "overrides_of",
    "question_key",
    "report_change",
    "sampled_title",
    "submit_evaluation",
]


def evaluate_policy(
    cfg: Any,
    retriever: Any,
    learner: Any,
    questions: list[dict],
    when: str,
    generators: Sequence[Any] = (),
) -> dict:
    """Exact match of greedy rollouts on the learner's current weights (no learner:
    ``cfg.model``'s own) and, with ``eval.samples``, of ``eval.samples`` sampled rollouts
    per question (under ``"sampled"``). ``generators`` (the training generators, between
    the steps they train) roll both out, the questions split over them, each brought to
    the learner's weights first; without them one generator of the evaluation's own is
    made for this evaluation only (so it holds no resources while training). None is
    used when both evaluations are kept from an earlier run of the same warm-started
    policy."""
    import ray

    greedy = replace(
        cfg.generator,
        temperature=0.0,
        group_size=1,
        max_new_tokens=cfg.eval.max_new_tokens or cfg.generator.max_new_tokens,
    )
    version = learner.policy_version if learner is not None else 0
    actor = None
    redone = 0

    def attempt(gen: Any) -> dict:
        """``gen``'s evaluation by the training generators, or by one made on first need;
        each brought to the learner's weights first (a restarted one is back on the base
        weights)."""
        nonlocal actor
        if generators:
            _bring_to(generators, learner, version, cfg.pipeline.timeout_s)
            return evaluate_on(generators, questions, cfg.pipeline.timeout_s, **overrides_of(gen))
        if actor is None:
            (actor,) = make_generators(cfg.model, retriever, cfg, greedy, prefix=None,
                                       count=1, num_cpus=cfg.resources.eval_cpus)  # fmt: skip
        _bring_to([actor], learner, version, cfg.pipeline.timeout_s)
        return evaluate(actor, questions, cfg.pipeline.timeout_s, **overrides_of(gen))

    def rollouts(gen: Any) -> dict:
        """:func:`attempt`, redone when a generator is lost under it (Ray restarts one made
        with ``max_restarts``), up to :data:`EVALUATION_RETRIES` times, each counted."""
        nonlocal redone
        for tries in range(EVALUATION_RETRIES + 1):
            try:
                return attempt(gen)
            except actor_lost_errors() as err:
                if tries == EVALUATION_RETRIES:
                    raise
                redone += 1
                log.info(
                    f"eval {when}: a generator was lost mid-evaluation ({type(err).__name__}: "
                    f"{str(err).strip().splitlines()[-1][:160]}); brought back to policy version "
                    f"{version} and the evaluation redone ({tries + 1} of "
                    f"{EVALUATION_RETRIES})"
                )

    try:
        result = _evaluation(cfg, questions, when, greedy, version, rollouts)
        if cfg.eval.samples:
            sampled = replace(greedy, temperature=cfg.generator.temperature,
                              group_size=cfg.eval.samples)  # fmt: skip
            result["sampled"] = _evaluation(cfg, questions, when, sampled, version, rollouts)
    finally:
        if actor is not None:
            ray.kill(actor)
    if redone:
        result["redone_after_a_lost_generator"] = redone
    return result


EVALUATION_RETRIES = 2
"""Times an evaluation is redone when a generator is lost under it (Ray restarts it when
it was made with ``max_restarts``; it comes back on the base weights and is brought to the
policy's before the evaluation is redone)."""


def _bring_to(generators: Sequence[Any], learner: Any, version: int, timeout_s: float) -> None:
    """The generators on the learner's weights: those behind it (the evaluation's own,
    made on the base weights; a training generator restarted since the last publication;
    a resumed run's evaluation before training) get them."""
    import ray

    if learner is None:
        return
    versions = ray.get([g.get_policy_version.remote() for g in generators], timeout=timeout_s)
    behind = [g for g, v in zip(generators, versions, strict=True) if v != version]
    if behind:
        from ray_credit.pipeline.weights import publication_dtype

        weights = learner.weights(dtype=publication_dtype(behind, timeout_s))
        ray.get([g.update_weights.remote(version, weights) for g in behind], timeout=timeout_s)


def _evaluation(
    cfg: Any, questions: list[dict], when: str, gen: Any, version: int, rollouts: Any
) -> dict:
    """One evaluation of :func:`evaluate_policy`: ``rollouts(gen)``, or at version 0 of a
    warm-started policy the same evaluation kept in its folder (and kept there when new)."""
    t0 = time.perf_counter()
    cached = _evaluation_file(cfg, gen, questions) if version == 0 else None
    greedy = gen.group_size == 1
    what = "EM" if greedy else "sampled EM"
    how = "" if greedy else f" ({gen.group_size} samples each at temperature {gen.temperature:g})"
    if cached is not None and cached.is_file():
        result = json.loads(cached.read_text())
        log.info(
            f"eval {when}: {what} {result['em']:.3f} on {len(questions)} held-out questions"
            f"{how} (policy version 0: the {'greedy' if greedy else 'sampled'} "
            f"evaluation of the same policy, questions and settings saved in {cached})",
        )
        return {**result, "reused": str(cached)}
    result = rollouts(gen)
    if cached is not None:
        cached.parent.mkdir(exist_ok=True)
        partial = cached.with_suffix(".partial")
        partial.write_text(json.dumps(result))
        partial.rename(cached)  # whole or absent
    log.info(
        f"eval {when}: {what} {result['em']:.3f} on {len(questions)} held-out questions{how} "
        f"(policy version {version}, {time.perf_counter() - t0:.0f}s)",
    )
    return result


def _evaluation_file(cfg: Any, gen: Any, questions: list[dict]) -> Path | None:
    """Where the evaluation of a warm-started policy (unchanged since it was saved)
    on ``questions`` is kept, in the policy's folder, named by a fingerprint of everything
    that decides it: the warm start's own fingerprint, the questions and their answers,
    the generator, retriever and data settings. Runs of several methods from one warm
    start (bench/learning.py) then evaluate it once. None: not a warm-started folder, or
    an external retriever (its index can change under the same URL)."""
    manifest = Path(cfg.model) / "warm_start.json"
    if not manifest.is_file() or cfg.retriever.url:
        return None
    settings = {
        "warm_start": json.loads(manifest.read_text())["fingerprint"],
        "questions": [[q["question"], list(q.get("golden_answers") or ())] for q in questions],
        "generator": asdict(gen),
        "retriever": asdict(cfg.retriever),
        "data": asdict(cfg.data),
    }
    return Path(cfg.model) / "evaluations" / f"{settings_fingerprint(settings)}.json"


def submit_evaluation(
    generator: Any, questions: Sequence[Mapping[str, Any]], **overrides: Any
) -> Any:
    """An ObjectRef to the exact match (overall and per data source) of ``generator``'s
    rollouts of ``questions`` (``overrides``: ``group_size``, ``temperature``, ``seed`` of
    this call, as :meth:`~ray_credit.actors.generator.Generator.generate` takes them); the
    batch is summarized by a task, never fetched here."""
    import ray

    batch = generator.generate.remote(list(questions), progress="held-out rollouts", **overrides)
    return ray.remote(eval_summary).options(num_cpus=0).remote(batch)


def evaluate(
    generator: Any, questions: Sequence[Mapping[str, Any]], timeout_s: float, **overrides: Any
) -> dict:
    """:func:`submit_evaluation`, waited for."""
    import ray

    return ray.get(submit_evaluation(generator, questions, **overrides), timeout=timeout_s)


def overrides_of(gen: Any) -> dict[str, Any]:
    """The per-call settings of :meth:`~ray_credit.actors.generator.Generator.generate`
    that make any generator roll out as ``gen`` (a GeneratorConfig) would."""
    return {"group_size": gen.group_size, "temperature": gen.temperature, "seed": gen.seed,
            "max_new_tokens": gen.max_new_tokens}  # fmt: skip


def evaluate_on(
    generators: Sequence[Any],
    questions: Sequence[Mapping[str, Any]],
    timeout_s: float,
    **overrides: Any,
) -> dict:
    """:func:`evaluate` with ``questions`` split over ``generators`` in order, the parts
    merged as one evaluation of the whole list (outcomes keyed by their place in it)."""
    import ray

    from ray_credit.stats import proportion_interval

    shares = [s for s in np.array_split(np.arange(len(questions)), len(generators)) if len(s)]
    refs = [
        submit_evaluation(g, [questions[i] for i in share], **overrides)
        for g, share in zip(generators, shares, strict=False)
    ]
    parts = ray.get(refs, timeout=timeout_s)
    if len(parts) == 1:
        return parts[0]
    counts: dict[str, int] = {}
    hits: dict[str, float] = {}
    searches: dict[str, float] = {}
    correct: dict[str, float] = {}
    source: dict[str, str] = {}
    for part, share in zip(parts, shares, strict=True):
        # each part numbers its own questions from 0; the result numbers the whole list
        for i, key in zip(share, part["correct"], strict=True):
            whole = question_key(int(i), questions[i]["question"])
            correct[whole], source[whole] = part["correct"][key], part["source"][key]
        for data_source, n in part["count_by_source"].items():
            counts[data_source] = counts.get(data_source, 0) + n
            hits[data_source] = hits.get(data_source, 0.0) + part["em_by_source"][data_source] * n
            searched = part["searches_by_source"][data_source] * n
            searches[data_source] = searches.get(data_source, 0.0) + searched
    total = sum(counts.values())
    samples = max(p["samples"] for p in parts)
    right = int(sum(correct.values())) if samples == 1 else 0
    return {
        "em": sum(hits.values()) / total,
        "em_interval": list(proportion_interval(right, total)) if samples == 1 else None,
        "em_by_source": {k: hits[k] / counts[k] for k in sorted(counts)},
        "count_by_source": dict(sorted(counts.items())),
        "correct": correct,
        "source": source,
        "answered": sum(p["answered"] * p["questions"] for p in parts) / total,
        "searches_per_traj": sum(searches.values()) / total,
        "searches_by_source": {k: searches[k] / counts[k] for k in sorted(counts)},
        "questions": total,
        "samples": samples,
    }


def question_key(position: int, question: str) -> str:
    """How an evaluation names a question in its per-question outcomes: an evaluation
    rolls its list out in order, one trajectory per question, so "<position>:<question>"
    pairs it with another evaluation of the same list (and tells repeats apart)."""
    return f"{position}:{question}"


def eval_summary(batch: Any) -> dict[str, Any]:
    """Exact match of the rollouts of each question (one, greedy; or several sampled:
    then a question's score is the share of its rollouts that are right), overall and per
    data source (runs where the batch is, in a Ray task). Exact match of the final answer
    (``ray_credit.qa.em_check``), not the outcome reward the run trains on."""
    from ray_credit.qa import em_check
    from ray_credit.stats import proportion_interval

    # exact match of the extracted answer, whatever reward the policy trains on (under
    # generator.reward subem or f1, an outcome of 1 is a substring or a word-set match)
    answers = batch.column("answer").to_pylist()
    golds = batch.column("gold_answers").to_pylist()
    right = np.array(
        [em_check(a, g) if a is not None else 0.0 for a, g in zip(answers, golds, strict=True)],
        dtype=np.float64,
    )
    searched = (batch.turn_values("turns.action") == "search").astype(np.int64)
    searches = np.add.reduceat(searched, batch.turn_offsets[:-1]) if len(batch) else searched
    starts = batch.group_starts if len(batch) else np.zeros(0, np.int64)

    def per_question(values: np.ndarray) -> np.ndarray:
        """Mean over each question's rollouts (groups come in the order of the questions)."""
        return np.add.reduceat(values, starts) / batch.group_sizes if len(batch) else values

    score, search = per_question(right), per_question(searches)
    sources = [s or "unknown" for s in batch.column("data_source").to_pylist()]
    sources = [sources[i] for i in starts]
    questions = batch.column("question").to_pylist()
    keys = [question_key(g, questions[i]) for g, i in enumerate(starts)]
    per_source: dict[str, list[float]] = {}
    searches_by_source: dict[str, list[float]] = {}
    for source, r, s in zip(sources, score, search, strict=True):
        per_source.setdefault(source, []).append(float(r))
        searches_by_source.setdefault(source, []).append(float(s))
    samples = int(batch.group_sizes.max()) if len(batch) else 1
    m, n = batch.metrics, max(len(batch), 1)
    return {
        "em": float(right.mean()) if len(batch) else 0.0,
        # a Wilson interval holds for one rollout per question (its outcomes independent)
        "em_interval": list(proportion_interval(int(right.sum()), len(right)))
        if len(batch) and samples == 1
        else None,
        "em_by_source": {k: float(np.mean(v)) for k, v in sorted(per_source.items())},
        "count_by_source": {k: len(v) for k, v in sorted(per_source.items())},
        "correct": dict(
            zip(keys, [float(v) if samples > 1 else int(v) for v in score], strict=True)
        ),
        "source": dict(zip(keys, sources, strict=True)),
        "answered": m.get("gen/answered", 0.0) / n,
        "searches_per_traj": m.get("gen/searches", 0.0) / n,
        "searches_by_source": {k: float(np.mean(v)) for k, v in sorted(searches_by_source.items())},
        "questions": len(keys),
        "samples": samples,
    }


def eval_metrics(result: Mapping[str, Any]) -> dict[str, float]:
    low, high = result.get("em_interval") or (result["em"], result["em"])
    metrics = {"eval/em": result["em"], "eval/em_low": low, "eval/em_high": high}
    if "sampled" in result:
        metrics["eval/em_sampled"] = result["sampled"]["em"]
    return metrics


def eval_change(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, dict]:
    """EM after minus EM before on the same held-out questions, with a paired 95 %
    bootstrap interval (:func:`ray_credit.stats.paired_difference`), overall ("all") and
    per data source."""
    from ray_credit.stats import paired_difference

    change = {"all": paired_difference(before["correct"], after["correct"])}
    for source in sorted(set(before["source"].values())):
        keys = [k for k, s in before["source"].items() if s == source]
        change[source] = paired_difference(
            {k: before["correct"][k] for k in keys}, {k: after["correct"][k] for k in keys}
        )
    return change


def report_change(summary: dict, logger: Any, step: int) -> None:
    """The paired change of held-out EM from before training to after (and the
    warm-start's own, when the base policy was evaluated): kept, printed and logged."""
    before, after = summary["eval_before"], summary["eval_after"]
    summary["eval_change"] = eval_change(before, after)
    title = "held-out EM, paired on the same questions"
    if before.get("step"):  # a resume with other settings evaluated where it resumed
        title += f", from step {before['step']} (where the run was resumed), not its start"
    log.info(describe_change(before, after, summary["eval_change"], title))
    if "eval_base" in summary and not before.get("step"):  # from step N it is not its part
        summary["eval_change_warm_start"] = eval_change(summary["eval_base"], before)
        warm = describe_change(summary["eval_base"], before, summary["eval_change_warm_start"])
        log.info(f"the warm-start's part ({warm})")
    change = summary["eval_change"]["all"]
    metrics = {"eval/em_change": change["diff"], "eval/em_change_low": change["low"],
               "eval/em_change_high": change["high"]}  # fmt: skip
    if "sampled" in before and "sampled" in after:
        b, a = before["sampled"], after["sampled"]
        summary["eval_change_sampled"] = eval_change(b, a)
        log.info(describe_change(b, a, summary["eval_change_sampled"], sampled_title(b, a)))
        sampled = summary["eval_change_sampled"]["all"]
        metrics |= {"eval/em_sampled_change": sampled["diff"],
                    "eval/em_sampled_change_low": sampled["low"],
                    "eval/em_sampled_change_high": sampled["high"]}  # fmt: skip
    logger.log(metrics, step=step)


def describe_change(
    before: Mapping,
    after: Mapping,
    change: Mapping[str, dict],
    title: str = "held-out EM, paired on the same questions",
) -> str:
    """Lines saying how held-out EM moved, with the paired interval, overall and per
    source, under ``title``."""
    lines = []
    for name, c in change.items():
        em_b = before["em"] if name == "all" else before["em_by_source"][name]
        em_a = after["em"] if name == "all" else after["em_by_source"][name]
        if c["better"] + c["worse"] == 0:
            interval = "no question changed"
        else:
            verdict = "excludes 0" if c["low"] > 0 or c["high"] < 0 else "includes 0"
            interval = f"95% CI {c['low']:+.3f}, {c['high']:+.3f}; {verdict}"
        # the sign test on the questions that moved: a bootstrap interval is too narrow
        # when few did (4 better, 0 worse of 120 questions excludes 0; the sign test says
        # p = 0.125)
        p_sign = c.get("p_sign")
        sign = f"; sign test p={p_sign:.3f}" if p_sign is not None else ""
        lines.append(
            f"  {name:<16} EM {em_b:.3f} -> {em_a:.3f}  change {c['diff']:+.3f} "
            f"[{interval}]  n={c['n']} "
            f"({c['better']} better, {c['worse']} worse{sign}){_searches(before, after, name)}"
        )
    return f"{title}:\n" + "\n".join(lines)


def sampled_title(before: Mapping, after: Mapping) -> str:
    """The title of :func:`describe_change` for the sampled EM (``eval.samples``) of two
    evaluations, with how many samples each took per question."""
    b, a = before["samples"], after["samples"]
    counts = f"{a}" if b == a else f"{b} before, {a} now"
    return (
        f"held-out sampled EM ({counts} samples per question), paired on the same questions "
        "(better/worse: questions whose share of right samples rose/fell)"
    )


def _searches(before: Mapping, after: Mapping, name: str) -> str:
    """The end of one line of :func:`describe_change`: how searches per question moved,
    where both evaluations counted them (an older summary did not, per source)."""
    if name == "all":
        b, a = before.get("searches_per_traj"), after.get("searches_per_traj")
    else:
        b = before.get("searches_by_source", {}).get(name)
        a = after.get("searches_by_source", {}).get(name)
    return "" if b is None or a is None else f", searches per question {b:.2f} -> {a:.2f}"
