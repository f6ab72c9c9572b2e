"""A method's plan: from its estimator's declaration to the stages and loss of a run.

An :class:`~ray_credit.estimators.Estimator` declares the signals its paper reads (with the
settings the paper uses) and the learner settings its paper trains with
(``Estimator.signals``, ``Estimator.learner``). This module turns that declaration into a
run:

* :func:`recipe_defaults` puts the declaration into a run config's defaults, under the
  YAML file and the flags: ``pipelines/a2tgpo.py --help`` shows A²TGPO's turn-level ratio
  and clip range as the defaults, and the info-gain signal's ``log_prob_diff``;
* :func:`make_plan` checks, before any actor starts, that the run can work: every column
  the estimator reads is made by a rollout or a declared signal, the judge backend can
  judge with the data at hand (the evidence judge needs supporting documents), Search-P1's
  LLM evaluator has reference plans (from the question file, or the ``reference_plan``
  signal runs first), the info-gain scorer gets its weights; and lists every setting the
  config changes from the paper's recipe (``departures``), which the run prints and keeps
  in its summary;
* :meth:`Plan.stages` builds the per-chunk stage list from the plan and the services
  that compute the signals (a judge pool, an info-gain scorer).

A run config carries the estimator's config in a section named after the estimator (a
composition of parts has none: its settings are in its text, the ``estimator`` setting), and
the settings of a signal that has any in a section named after the signal
(``cw_grpo_judgement.skip_failed``, ``info_gain.mode``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ray_credit.batch import ROLLOUT_COLUMNS
from ray_credit.config import InputError, apply_overrides
from ray_credit.estimators import Estimator, get_estimator
from ray_credit.pipeline.published import get_path
from ray_credit.signals import JudgedSignal, Signal, get_signal

__all__ = ["Plan", "make_plan", "recipe_defaults"]


def recipe_defaults(config: Any, estimator: str | Estimator) -> Any:
    """``config`` with the estimator's declared learner settings and signal settings put
    in (the paper's recipe, as the defaults the YAML file and the flags start from)."""
    est = get_estimator(estimator) if isinstance(estimator, str) else estimator
    config = dataclasses.replace(config, learner=apply_overrides(config.learner, est.learner))
    for name, settings in est.signals.items():
        if _has_settings(get_signal(name)):
            section = _signal_section(config, name)
            config = dataclasses.replace(config, **{name: dataclasses.replace(section, **settings)})
    return config


@dataclass(frozen=True)
class Plan:
    """What a run computes besides rollouts and the update (see the module docstring)."""

    estimator: Estimator
    estimator_config: Any
    signals: tuple[Signal, ...]
    """Filled on every chunk, in order, before the estimator."""
    question_signals: tuple[JudgedSignal, ...]
    """Made once over the training questions before training (reference plans)."""
    departures: tuple[str, ...]
    """Settings of this run that differ from the paper's recipe, as ``key = value
    (recipe: value)``, and the user's own stages."""
    extra_stages: tuple[Callable, ...] = ()
    """The user's stages, run after the signals and before the estimator."""
    extra_stages_after: tuple[Callable, ...] = ()
    """The user's stages, run after the estimator."""

    @property
    def services(self) -> set[str]:
        """What computes the signals: ``"judge"`` and/or ``"scorer"``."""
        return {s.service for s in (*self.signals, *self.question_signals)}

    def stages(
        self, *, judges: Any = None, scorer: Any = None, timeout_s: float
    ) -> tuple[list, list]:
        """(per-chunk stages, per-step stages): each signal from its service, the user's
        stages, the estimator, the user's stages after it; per chunk up to the first
        that is not group-local (``group_local = False``), once per step from there."""
        from ray_credit.pipeline.runner import actor_stage, estimator_stage

        stages = []
        for signal in self.signals:
            if signal.service == "judge":
                stages.append(judges.stage(signal))
            else:
                stages.append(actor_stage(scorer.score, name=signal.name, timeout_s=timeout_s))
        estimator = estimator_stage(self.estimator, **dataclasses.asdict(self.estimator_config))
        rest = [*self.extra_stages, estimator, *self.extra_stages_after]
        for i, stage in enumerate(rest):
            if not getattr(stage, "group_local", True):
                return [*stages, *rest[:i]], rest[i:]
        return [*stages, *rest], []


def make_plan(
    config: Any,
    estimator: str | Estimator,
    questions: Sequence[Mapping[str, Any]],
    *,
    stages: Sequence[Callable] = (),
    stages_after: Sequence[Callable] = (),
) -> Plan:
    """The plan of a run (module docstring), with the user's own ``stages`` (before the
    estimator) and ``stages_after`` (after it); raises ``ValueError`` naming what cannot
    work, and what to do, before any actor starts."""
    est = get_estimator(estimator) if isinstance(estimator, str) else estimator
    extra = []
    for where, given in (("before", stages), ("after", stages_after)):
        if callable(given):
            given = [given]
        for stage in given:
            if not callable(stage):
                raise InputError(
                    f"stages{'' if where == 'before' else '_after'} takes functions batch -> "
                    f"batch, got {stage!r} ({type(stage).__name__})"
                )
            name = getattr(stage, "__name__", type(stage).__name__)
            extra.append(f"stage {name!r} of your own, {where} the estimator")
    judge = getattr(config, "judge", None)  # only the judged methods' configs have one
    backend = None if judge is None else judge.backend
    signals = tuple(_configured(config, name) for name in est.signals)
    provided = set(ROLLOUT_COLUMNS) | {c for s in signals for c in s.columns}
    missing = [c for c in est.requires if c not in provided]
    if missing:
        raise InputError(
            f"estimator {est.name!r} reads {missing}, which neither a rollout nor its declared "
            f"signals {list(est.signals)} write; declare the signal that makes them "
            "(Estimator(signals={...}))"
        )
    question_signals: list[JudgedSignal] = []
    for signal in signals:
        if signal.service == "judge":
            if backend is None:
                raise InputError(
                    f"estimator {est.name!r} needs the {signal.name} signal from a judge: the "
                    "run config needs a judge section (JudgeConfig)"
                )
            question_signals += _check_judged(signal, backend, questions)
        elif config.pipeline.weight_sync != "object_store":
            raise InputError(
                f"the {signal.name} signal scores with the policy's weights, which reach "
                f"the scorer through the object store; pipeline.weight_sync="
                f"{config.pipeline.weight_sync!r} broadcasts to generators only: use "
                "--pipeline.weight_sync object_store"
            )
    if dataclasses.fields(est.config_cls):
        estimator_config = getattr(config, est.name, None)
    else:  # no settings (a composition: they are in its text), no section
        estimator_config = est.config_cls()
    if not isinstance(estimator_config, est.config_cls):
        raise InputError(
            f"{type(config).__name__} needs a section '{est.name}: {est.config_cls.__name__}' "
            f"for the estimator's settings (the section is named after the estimator)"
        )
    return Plan(
        estimator=est,
        estimator_config=estimator_config,
        signals=signals,
        question_signals=tuple(question_signals),
        departures=(*_departures(config, est), *extra),
        extra_stages=tuple([stages] if callable(stages) else stages),
        extra_stages_after=tuple([stages_after] if callable(stages_after) else stages_after),
    )


def _check_judged(
    signal: JudgedSignal, backend: str, questions: Sequence[Mapping[str, Any]]
) -> list[JudgedSignal]:
    """The question-level signals this judged signal needs first (raises when the judge
    cannot judge it with this data)."""
    needs = signal.requires("evidence" if backend == "evidence" else "llm")
    if "supporting_doc_ids" in needs and not any(q.get("supporting_doc_ids") for q in questions):
        raise InputError(
            f"the evidence judge gives the {signal.name} signal from supporting documents, and "
            "no training question has supporting_doc_ids; use an LLM judge: --judge.backend "
            "hf --judge.model M, or --judge.backend openai --judge.base_url URL --judge.model M"
        )
    if "reference_plan" in needs and not all(q.get("reference_plan") for q in questions):
        return [get_signal("reference_plan")]  # made before training, for those without
    return []


def _configured(config: Any, name: str) -> Signal:
    """The signal with the run's settings (its config section), else the registered one."""
    signal = get_signal(name)
    return _signal_section(config, name) if _has_settings(signal) else signal


def _signal_section(config: Any, name: str) -> Signal:
    section = getattr(config, name, None)
    if not isinstance(section, Signal):
        raise ValueError(
            f"the {name} signal has settings, so {type(config).__name__} needs a section "
            f"'{name}: {type(get_signal(name)).__name__}' for them"
        )
    return section


def _has_settings(signal: Signal) -> bool:
    return bool(dataclasses.fields(signal))


def _departures(config: Any, est: Estimator) -> list[str]:
    """``key = value (recipe: value)`` for every declared setting the config changed."""
    out = []
    for key, wanted in est.learner.items():
        got = get_path(config.learner, key)
        if got != wanted:
            out.append(f"learner.{key} = {got!r} (recipe: {wanted!r})")
    for name, settings in est.signals.items():
        signal = _configured(config, name)
        for key, wanted in settings.items():
            got = getattr(signal, key)
            if got != wanted:
                out.append(f"{name}.{key} = {got!r} (recipe: {wanted!r})")
    return out
