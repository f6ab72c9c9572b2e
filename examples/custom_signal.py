"""A user-defined judged signal and an estimator that reads it, trained end to end.

Nothing in ray_credit is edited. The signal is one class (its column, its prompt, the
shape of its reply, its parser and an evidence rule); the estimator names it in its
declaration, and the pipeline builds the stage that fills it on every chunk:

    python examples/custom_signal.py                     # the signal on a hand-made batch
    python examples/custom_signal.py --pipeline.steps 2  # and a 2-step training run
    python examples/custom_signal.py --pipeline.steps 2 --judge.backend hf  # a local judge

The signal, "answer_grounded": is the trajectory's final answer stated in a document it
retrieved? The estimator, "grounded_grpo": GRPO on the outcome plus a bonus for grounded
answers. (Made-up rules, to show the shape.)
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import pyarrow as pa

from ray_credit import (
    Estimator,
    JudgeConfig,
    JudgedSignal,
    JudgePool,
    RunConfig,
    TrajectoryBatch,
    get_estimator,
    load_config,
    parse_config,
    register_estimator,
    register_signal,
    train,
)
from ray_credit.batch import ColumnSpec
from ray_credit.qa import contains_gold
from ray_credit.signals import Choice, Request, parse_json_object, render_trace

PROMPT = """Read a search agent's work on a question and its final answer. Say whether the
final answer is stated in the information the searches returned (not whether it is right).

Question: {question}

{trace}

Final answer: {answer}

Reply with one JSON object: {{"grounded": 1}} if the answer is stated in the information
above, else {{"grounded": 0}}."""


@dataclass(frozen=True)
class AnswerGrounded(JudgedSignal):
    """Is the final answer stated in a document the trajectory retrieved?"""

    name: ClassVar[str] = "answer_grounded"
    level: ClassVar[str] = "trajectory"
    columns: ClassVar[Mapping[str, ColumnSpec]] = {
        "answer_grounded": ColumnSpec(
            pa.int8(),
            "traj",
            "1: the final answer appears in a retrieved document; null: not judged",
            producer="The answer_grounded signal (examples/custom_signal.py).",
        )
    }
    llm_requires: ClassVar[tuple[str, ...]] = ("question", "answer", "turns")
    evidence_requires: ClassVar[tuple[str, ...]] = ("answer", "turns")

    def request(self, row: Mapping[str, Any], turn: int | None) -> Request | None:
        if row["answer"] is None:
            return None  # nothing to judge: null, counted as judge/no_evidence
        prompt = PROMPT.format(
            question=row["question"], trace=render_trace(row["turns"]), answer=row["answer"]
        )
        return Request(prompt, (("grounded", Choice((0, 1))),))

    def parse(self, reply: str, context: Any) -> dict[str, int] | None:
        obj = parse_json_object(reply)
        value = None if obj is None else obj.get("grounded")
        return {"answer_grounded": value} if type(value) is int and value in (0, 1) else None

    def evidence(self, rows, documents=None) -> list[dict[str, int] | None]:
        out = []
        for row in rows:
            if row["answer"] is None:
                out.append(None)
                continue
            seen = [t["observation"] for t in row["turns"] if t["observation"]]
            grounded = any(contains_gold(obs, [row["answer"]]) for obs in seen)
            out.append({"answer_grounded": int(grounded)})
        return out


@dataclass(frozen=True)
class GroundedGRPOConfig:
    """Knobs of the example estimator."""

    bonus: float = 0.5
    """Added to the outcome reward of a trajectory whose answer is grounded."""


def grounded_grpo(batch: TrajectoryBatch, config: GroundedGRPOConfig) -> TrajectoryBatch:
    grounded = batch.traj_values("answer_grounded", null=0.0)  # not judged: no bonus
    shaped = batch.traj_values("outcome_reward") + config.bonus * grounded
    out = get_estimator("grpo")(batch.with_traj_columns({"outcome_reward": shaped}))
    return batch.with_turn_columns(
        {"turn_advantages": out.turn_values("turn_advantages")},
        metrics={
            "grounded_grpo/grounded": float(grounded.sum()),
            "grounded_grpo/unjudged": float((~batch.traj_valid("answer_grounded")).sum()),
        },
    )


SIGNAL = register_signal(AnswerGrounded())
ESTIMATOR = register_estimator(
    Estimator(
        "grounded_grpo",
        grounded_grpo,
        GroundedGRPOConfig,
        requires=("group_id", "outcome_reward", "answer_grounded"),
        description="GRPO with a bonus for grounded answers (an example)",
        signals={"answer_grounded": {}},  # the pipeline adds the stage that fills it
    )
)


@dataclass(frozen=True)
class GroundedRun(RunConfig):
    """A run of grounded_grpo: a judge section, and the estimator's section by its name."""

    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """Who judges answer_grounded (the evidence rule by default)."""
    grounded_grpo: GroundedGRPOConfig = field(default_factory=GroundedGRPOConfig)
    """The estimator's knobs."""


def train_with_it(steps: int, judge: str) -> None:
    """A training run of the estimator: the plan sees its declared signal and puts a judge
    stage before it (the evidence rule, or a local model on a judge actor)."""
    out = tempfile.TemporaryDirectory(prefix="custom_signal_")  # removed at the end
    argv = [
        "--name", "grounded-grpo", "--model", "tiny-random", "--wandb", "disabled",
        "--output_dir", out.name, "--data.eval_questions", "4",
        "--pipeline.steps", str(steps), "--pipeline.groups_per_step", "2",
        "--resources.learner_cpus", "1", "--eval.enabled", "false",
        "--generator.group_size", "4",
        # a tiny random model: no warm-start to show, and the transformers sampler starts
        # in a second where a vLLM engine takes half a minute
        "--warm_start.enabled", "false", "--generator.backend", "transformers",
    ]  # fmt: skip
    if judge == "hf":
        argv += ["--judge.backend", "hf", "--judge.model", "tiny-random"]
        argv += ["--resources.judge_cpus", "0.5"]
    cfg = load_config(GroundedRun, "grounded_grpo", argv)  # on the embedded settings
    with out:
        summary = train(cfg, "grounded_grpo")
    last = summary["final_step_metrics"]
    print(
        f"trained {summary['steps']} steps with grounded_grpo ({judge} judge): "
        f"{last['judge/requests']:.0f} judgements in the last step, "
        f"{last['grounded_grpo/grounded']:.0f} grounded, "
        f"{last['grounded_grpo/unjudged']:.0f} unjudged"
    )


@dataclass(frozen=True)
class PipelineFlags:
    """The training run (a pipeline's --pipeline.* of the same name)."""

    steps: int = 0
    """Learner updates of a training run with the estimator (0: no run, the batch only)."""


@dataclass(frozen=True)
class JudgeFlags:
    """Who judges answer_grounded in the training run (a pipeline's --judge.*)."""

    backend: Literal["evidence", "hf"] = "evidence"
    """'evidence' (the signal's rule) or 'hf' (a local tiny-random model on a judge actor)."""


@dataclass(frozen=True)
class Flags:
    pipeline: PipelineFlags = field(default_factory=PipelineFlags)
    judge: JudgeFlags = field(default_factory=JudgeFlags)


def main() -> None:
    args = parse_config(Flags, description=__doc__)  # --help: every flag, its default
    turn = {"text": "<search> seal </search>", "action": "search", "policy_version": 0}
    records = [
        {
            "group_id": "q",
            "traj_id": f"t{i}",
            "question": "Where is the seal kept?",
            "gold_answers": ["Velmora Hall"],
            "turns": [
                {**turn, "observation": "The seal rests in Velmora Hall."},
                {"text": f"<answer> {answer} </answer>", "action": "answer", "policy_version": 0},
            ],
            "answer": answer,
            "outcome_reward": float(answer == "Velmora Hall"),
        }
        for i, answer in enumerate(["Velmora Hall", "the old tower"])
    ]
    batch = JudgePool("evidence").judge("answer_grounded", TrajectoryBatch.from_records(records))
    print("answer_grounded:", batch.column("answer_grounded").to_pylist())
    out = get_estimator("grounded_grpo")(batch)
    print(
        "turn advantages:",
        [[round(a, 3) for a in r] for r in out.column("turn_advantages").to_pylist()],
    )
    if args.pipeline.steps:
        train_with_it(args.pipeline.steps, args.judge.backend)


if __name__ == "__main__":
    main()
