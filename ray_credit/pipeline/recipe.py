"""One training run, top to bottom: :func:`train`.

The run's story: its settings are checked and its data and plan made before Ray starts
(everything a user can get wrong is refused there, in one line); then the retriever, the
warm-start, the learner and the evaluation before training; then the judges, the scorer,
the generators and the asynchronous pipeline; then the evaluation after training and the
outputs. Each chapter lives in a room of its own: the settings in
:mod:`~ray_credit.pipeline.configs`, the checks in :mod:`~ray_credit.pipeline.preflight`,
the questions in :mod:`~ray_credit.pipeline.questions`, the services in
:mod:`~ray_credit.pipeline.services`, the evaluation in
:mod:`~ray_credit.pipeline.evaluation`, the outputs in :mod:`~ray_credit.pipeline.outputs`,
the loop in :mod:`~ray_credit.pipeline.runner`; a pipeline script's command line in
:mod:`~ray_credit.pipeline.cli`.

:func:`train` connects to Ray (the cluster of ``ray job submit`` / ``RAY_ADDRESS``, else
a local one) and writes, under ``output_dir/name``: ``metrics.jsonl`` (one line per step),
``summary.json``, ``plot.png`` (reward and EM over steps), the checkpoint, Search-P1's
reference plans when it makes them, and wandb's run (offline unless asked). The driver
never holds a batch: evaluation and training batches are read by Ray tasks and actors,
the driver gets their summaries.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from typing import Any

from ray_credit.config import check_config
from ray_credit.log import log, setup_logging
from ray_credit.pipeline.evaluation import eval_metrics, evaluate_policy, report_change
from ray_credit.pipeline.memory import index_vectors, report_memory
from ray_credit.pipeline.outputs import RunOutputs
from ray_credit.pipeline.placement import run_asks
from ray_credit.pipeline.plan import make_plan
from ray_credit.pipeline.preflight import (
    check_index_settings,
    check_resume_folder,
    checked_demonstrations,
    preflight,
)
from ray_credit.pipeline.published import setup_departures
from ray_credit.pipeline.questions import judge_identity, load_data, with_reference_plans
from ray_credit.pipeline.runner import Pipeline
from ray_credit.pipeline.services import (
    connect,
    make_generators,
    make_judge_pool,
    make_learner,
    make_retriever,
    make_scorer,
    reserve_slice_bundles,
    resource_demand,
    shared_gpu_bundle,
    wait_started,
)
from ray_credit.warm_start import rl_questions

__all__ = ["train"]


def train(
    cfg: Any,
    estimator: Any,
    *,
    stages: Sequence[Callable] = (),
    stages_after: Sequence[Callable] = (),
) -> dict:
    """Run one training job of ``estimator`` (a registered name or an
    :class:`~ray_credit.estimators.Estimator`) with ``cfg`` (a
    :class:`~ray_credit.pipeline.configs.RunConfig` with the estimator's section); returns
    the summary it writes.

    ``stages``: ``batch -> batch`` functions of your own, run on every chunk after the
    method's signals and before its estimator (a reward term, a column the estimator
    reads); ``stages_after``: after the estimator (reweighting the advantages). Their
    metrics join the step's; a function whose ``group_local`` attribute is False runs once
    per step on the step's whole batch instead, and so does everything after it. The run
    says that it departs from the method's recipe by them.
    """
    check_config(cfg)  # every section's check(), as parse_config does
    setup_logging(cfg.log_level)
    t_start = time.perf_counter()
    run_config = asdict(cfg)  # as given: what a --resume of this run starts from
    outputs = RunOutputs(cfg)  # refuses a storage_path it cannot write, before Ray starts
    # Data and the method's plan: everything that can be refused is refused here.
    corpus, train_q, eval_q = load_data(cfg.data, seed=cfg.pipeline.seed)
    check_index_settings(cfg, corpus)
    titles = checked_demonstrations(cfg, corpus, train_q) if cfg.warm_start.enabled else {}
    rl_q = rl_questions(train_q, cfg.warm_start)  # all, or those not demonstrated
    plan = make_plan(cfg, estimator, rl_q, stages=stages, stages_after=stages_after)
    for departure in plan.departures:
        log.info(f"note: departs from {plan.estimator.name}'s recipe: {departure}")
    setup = [f"{cfg.reproduces}: {line}" for line in setup_departures(cfg)]
    for departure in setup:
        log.info(f"note: departs from {departure}")
    plan = replace(plan, departures=(*plan.departures, *setup))  # kept in the summary
    preflight(cfg, rl_q)
    # per GPU, estimated (the index slices of a GPU share too); a warning where it will not fit
    report_memory(cfg, plan.services, index_vectors(cfg, corpus))
    if cfg.resume is not None:  # the newest whole checkpoint in the folder given
        cfg = replace(cfg, resume=str(check_resume_folder(cfg.resume)))
    resumed_step = outputs.resume(cfg.resume)
    # Ray, the retriever, the outputs.
    # Placed before any actor starts (a local Ray's plan before Ray itself), and printed.
    ray = connect(cfg, resource_demand(cfg, plan), asks=run_asks(cfg, plan.services))
    log.info(
        f"data: {len(train_q)} training questions, {len(eval_q)} held out"
        + (f"; RL draws from the {len(rl_q)} the warm-start does not demonstrate"
           if len(rl_q) < len(train_q) else "")
    )  # fmt: skip
    # With retriever_gpu_share, the learners' and generators' GPUs are reserved first: the
    # retriever's index slices start there, then the learner and the generators beside them.
    slices = reserve_slice_bundles(cfg, plan)
    retrievers = make_retriever(corpus, cfg.retriever, cfg.resources, cfg.retriever.index_folder,
                                slices)  # fmt: skip
    retriever = retrievers[0]  # the warm-start's and the evaluation's
    summary = outputs.open(cfg, run_config, plan.estimator.name, plan, resumed_step)
    # The warm-start: every actor below then loads the warm-started policy as its model.
    if cfg.warm_start.enabled:
        cfg = _warm_start(cfg, retriever, train_q, eval_q, titles, outputs)
    summary["policy"] = cfg.model  # what every actor below loads
    learner = make_learner(cfg, slices)
    # The generators (and the scorer, on its own GPU or on generator 0's); the evaluations
    # run on them unless eval.generators is 'own'.
    shared = shared_gpu_bundle(cfg, plan, slices)
    scorer = make_scorer(cfg, plan, shared) if "scorer" in plan.services else None
    generators = make_generators(cfg.model, retrievers, cfg, cfg.generator, prefix="gen",
                                 shared=shared, slices=slices)  # fmt: skip
    wait_started({"info-gain scorer": scorer} if scorer is not None else {})
    wait_started({f"generator {i}": g for i, g in enumerate(generators)})
    evaluators = generators if cfg.eval.generators == "training" else ()
    _evaluate_before(cfg, retriever, learner, eval_q, outputs, resumed_step, evaluators)
    outputs.save()  # a run cut off later keeps what it measured so far
    # The pipeline: signals' services, the asynchronous loop.
    judges = make_judge_pool(cfg.judge, cfg.resources) if "judge" in plan.services else None
    if judges is not None:  # only a judged method's config has a judge section
        rl_q = with_reference_plans(plan, judges, rl_q, outputs.out / "reference_plans.jsonl",
                                    made_by=judge_identity(cfg.judge))  # fmt: skip
    pipe_cfg = cfg.pipeline
    if pipe_cfg.checkpoint_dir is None:
        pipe_cfg = replace(pipe_cfg, checkpoint_dir=str(outputs.storage / "checkpoint"))
    chunk_stages, step_stages = plan.stages(
        judges=judges, scorer=scorer, timeout_s=pipe_cfg.timeout_s
    )
    pipeline = Pipeline(
        generators,
        learner,
        rl_q,
        chunk_stages,
        pipe_cfg,
        step_stages=step_stages,
        weight_targets=[scorer] if scorer is not None else [],
        resume_from=cfg.resume,
        on_step=lambda metrics: outputs.step(metrics, pipe_cfg.steps),
        metadata={"run_config": run_config},
        services=_memory_reporters(retrievers, scorer),
    )
    history = pipeline.run()
    summary.update(steps=pipeline.step, groups_trained=len(pipeline.trained_groups),
                   checkpoint=pipe_cfg.checkpoint_dir)  # fmt: skip
    # Training's scorer is done, and so are its generators unless they evaluate: their
    # memory (a vLLM engine's KV cache each) goes back before an evaluation's own starts.
    evaluators = pipeline.live_generators if evaluators else ()
    for actor in [*([scorer] if scorer is not None else []),
                  *(a for a in pipeline.generators if a not in evaluators)]:  # fmt: skip
        ray.kill(actor)
    # Evaluation after training, and the outputs.
    if cfg.eval.enabled:
        when = f"after {pipeline.step} steps"
        summary["eval_after"] = evaluate_policy(cfg, retriever, learner, eval_q, when, evaluators)
        outputs.logger.log(eval_metrics(summary["eval_after"]), step=pipeline.step)
        if "eval_before" in summary:
            report_change(summary, outputs.logger, pipeline.step)
    for actor in evaluators:
        ray.kill(actor)
    summary["final_step_metrics"] = history[-1] if history else {}
    summary["seconds"] = time.perf_counter() - t_start
    outputs.close()
    learner.shutdown()
    if slices is not None:  # the index slices and their GPUs' reservation
        slices.remove()
    out = outputs.out
    log.info(f"wrote {out}/summary.json, {out}/plot.png, {out}/metrics.jsonl, checkpoint "
             f"{pipe_cfg.checkpoint_dir}")  # fmt: skip
    return summary


def _memory_reporters(retrievers: Sequence[Any], scorer: Any) -> dict[str, list]:
    """The service actors whose memory each step reports: the retriever's replicas (not
    a client of a server of the user's own) and the info-gain scorer."""
    from ray_credit.actors.generator import NamedActor

    services = {"retriever": [r.handle for r in retrievers if isinstance(r, NamedActor)]}
    if scorer is not None:
        services["scorer"] = [scorer]
    return {role: actors for role, actors in services.items() if actors}


def _warm_start(
    cfg: Any,
    retriever: Any,
    train_q: list[dict],
    eval_q: list[dict],
    titles: dict[str, str],
    outputs: RunOutputs,
) -> Any:
    """Evaluate the base policy (``eval.before_warm_start``), fine-tune it on scripted
    demonstrations of the training questions as a Ray Train job on the learner's workers
    (:func:`ray_credit.warm_start.warm_start`, :func:`_fit_on_ray_train`), and return
    ``cfg`` with ``model`` set to the warm-started folder."""

    from ray_credit.warm_start import warm_start

    summary = outputs.summary
    if cfg.eval.enabled and cfg.eval.before_warm_start and "eval_base" not in summary:
        summary["eval_base"] = evaluate_policy(
            cfg, retriever, None, eval_q, "before the warm-start"
        )
    res, ws = cfg.resources, cfg.warm_start
    folder = ws.folder or str(outputs.shared / "warm_start")
    t0 = time.perf_counter()
    fit = functools.partial(_fit_on_ray_train, cfg, outputs.storage)
    manifest = warm_start(cfg.model, train_q, titles, retriever, cfg.generator, ws, folder,
                          fit=fit)  # fmt: skip
    m = manifest["metrics"]
    log.info(
        f"warm-start: {'reused ' + folder if manifest['reused'] else 'saved in ' + folder}; "
        f"{m['warm_start/demonstrations']:.0f} demonstrations of {m['warm_start/questions']:.0f} "
        f"questions ({m['warm_start/left_out_no_gold_seen']:.0f} left out: no gold answer seen), "
        f"loss {m['warm_start/loss_first_epoch']:.3f} -> {m['warm_start/loss_last_epoch']:.3f} "
        f"over {ws.epochs} epoch(s) ({time.perf_counter() - t0:.0f}s"
        + (f"; Ray Train, {res.learner_workers} worker(s)" if not manifest["reused"] else "")
        + ")",
    )
    summary["warm_start"] = {
        "folder": folder,
        "reused": manifest["reused"],
        "weights_sha256": manifest["weights_sha256"],  # which weights, wherever made
        **m,
    }
    outputs.logger.log(m, step=0)
    return replace(cfg, model=folder)


def _fit_on_ray_train(cfg: Any, storage: Any, demos: Any, pad: int, out: Any, fingerprint: str
                      ) -> dict:  # fmt: skip
    """The warm-start's fine-tuning as a Ray Train job on the learner's workers and
    resources (:func:`ray_credit.sft.fine_tune`), its checkpoints in the run's storage
    under a name of the settings' fingerprint (a run started again resumes them), deleted
    once the policy is saved."""
    from ray_credit.sft import FitConfig, fine_tune

    res, ws = cfg.resources, cfg.warm_start
    fit = FitConfig(
        epochs=ws.epochs, lr=ws.lr, batch_size=ws.batch_size,
        micro_batch_tokens=ws.micro_batch_tokens, autocast=ws.autocast, seed=ws.seed,
        workers=res.learner_workers, strategy=res.learner_strategy, use_gpu=res.use_gpu,
        cpus_per_worker=res.learner_cpus, gpus_per_worker=res.learner_gpus,
        learner_resource=res.learner_resource,
    )  # fmt: skip
    name = f"warm_start_fit-{fingerprint}"
    local = storage.local_path  # Ray Train takes an absolute path or a URI
    where = str(local.resolve()) if local is not None else str(storage)
    result = fine_tune(cfg.model, demos, fit, pad_token_id=pad, storage_path=where,
                       name=name, out=out)  # fmt: skip
    (storage / name).delete()
    return result


def _evaluate_before(
    cfg: Any,
    retriever: Any,
    learner: Any,
    eval_q: list[dict],
    outputs: RunOutputs,
    resumed_step: int | None,
    generators: Any,
) -> None:
    """The evaluation before training, on the learner's weights (by ``generators``, the
    training ones, or else by one of its own): a resumed run keeps its first start's when
    what decides it is unchanged, else evaluates the resumed policy (and says at which
    step, ``eval_before["step"]``)."""
    if not cfg.eval.enabled:
        return
    summary = outputs.summary
    if "eval_before" in summary:
        step = summary["eval_before"].get("step")
        log.info(
            f"eval before training: EM {summary['eval_before']['em']:.3f} on {len(eval_q)} "
            f"held-out questions (kept from {outputs.out / 'summary.json'}: "
            + (f"at step {step}, where the run was resumed with other settings)" if step
               else "before the run's first step)")
        )  # fmt: skip
        return
    when = "before training" if resumed_step is None else f"at step {resumed_step}"
    summary["eval_before"] = evaluate_policy(cfg, retriever, learner, eval_q, when, generators)
    if resumed_step is not None:  # not the run's start: the change is measured from here
        summary["eval_before"]["step"] = resumed_step
    outputs.logger.log(eval_metrics(summary["eval_before"]), step=resumed_step or 0)
