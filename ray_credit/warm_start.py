"""A supervised warm-start on demonstrations of the search protocol, before RL.

A 135M policy that has never seen the protocol rarely finds a document with the answer
in it, so most groups are all wrong and RL gets little signal. The warm-start shows it
the protocol once:

1. **Demonstrations.** A scripted expert plays each training question through the real
   :class:`~ray_credit.actors.generator.Generator` loop: same prompt, same retriever,
   same observation format and limits. Its turns search the title of each supporting
   document in hop order, then answer the first gold answer. The ids trained on are
   exactly the ids the generator fed, as in an RL batch. A demonstration whose
   observations never held a gold answer (the retriever missed the document, or the
   hops do not fit ``max_turns``) is left out: it would teach answering without
   evidence. Kept and left-out counts are in the metrics.
2. **Fine-tuning.** Mean token cross-entropy on the expert's tokens (``loss_mask``),
   AdamW, linear decay, ``epochs`` passes; the policy is saved as a Hugging Face folder
   that every actor of the run (generators, learner, reference, scorer, evaluation) then
   loads as its model. A pipeline runs it as a Ray Train job on the learner's workers and
   resources (:mod:`ray_credit.sft`: DDP or FSDP, checkpoints in the run's storage);
   without Ray it runs in the calling process.

It needs questions with ``supporting_doc_ids`` (the synthetic world has them; Search-R1's
parquet files do not) and a corpus whose first line of each document is its title.
Only training questions are demonstrated; the held-out ones never are.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ray_credit.actors.sampling import SampledTurn, SamplingParams
from ray_credit.batch import TrajectoryBatch
from ray_credit.config import InputError, check_fields
from ray_credit.models import Autocast

__all__ = ["ScriptedSampler", "WarmStartConfig", "demonstrate", "expert_turns", "warm_start"]

_MANIFEST = "warm_start.json"
# Bumped when the same settings come to make other demonstrations or another loss (2: a
# detour's search is not taught), so that an older warm start is not reused for a newer.
_DEMONSTRATION_FORMAT = 2
# The generator settings that shape a demonstration (sampling settings do not: the expert
# does not sample); a warm start made under other values of these is not reused.
_PROTOCOL_FIELDS = (
    "prompt_template", "system_prompt", "response_prefix", "final_turn_prefix",
    "action_style", "max_turns", "max_new_tokens", "max_observation_tokens",
    "max_context_tokens", "topk",
)  # fmt: skip


RLQuestions = Literal["all", "undemonstrated"]


@dataclass(frozen=True)
class WarmStartConfig:
    """Supervised fine-tuning on scripted demonstrations before RL (off by default)."""

    enabled: bool = False
    """Fine-tune the policy on demonstrations before RL; RL then starts from that policy."""
    questions: int = 0
    """Training questions to demonstrate (0: all of them)."""
    epochs: int = 2
    """Passes over the demonstrations."""
    lr: float = 1e-4
    """Peak AdamW learning rate (linear decay to 0 over the warm-start)."""
    batch_size: int = 16
    """Demonstrations per optimizer step."""
    micro_batch_tokens: int = 4096
    """Padded tokens per forward pass."""
    autocast: Autocast | None = None
    """Mixed precision of the fine-tuning (as ``learner.autocast``: "auto", "bfloat16",
    "float16" or None); the saved weights are float32 either way."""
    detours: float = 0.0
    """Share of the demonstrations with a turn to spare in which the expert, after the
    searches it needs, searches one more title (another question's supporting document)
    before it answers. The answer is then read from an earlier document than the last:
    RL's extra searches otherwise meet a policy that only ever answered from the last
    document it read (docs/learning.md)."""
    seed: int = 0
    """Order of the demonstrations, the questions picked and the detours."""
    hops: tuple[int, ...] | None = None
    """Demonstrate only training questions of these hop counts (None: any), e.g. ``[1]``:
    the policy learns the protocol on 1-hop questions and meets longer ones only in RL,
    where most of their groups are then all wrong (docs/learning.md)."""
    rl_questions: RLQuestions = "all"
    """Which training questions RL draws from after the warm-start: ``"all"``, or
    ``"undemonstrated"`` (those it did not demonstrate: it fits its demonstrations, so
    their groups mostly come out all right and carry no advantage). On the embedded task
    "undemonstrated" doubled the all-wrong groups and lowered held-out EM in both seeds
    measured (docs/learning.md). Not a setting of the warm-start itself: a saved
    warm-start is reused whichever is chosen."""
    folder: str | None = None
    """Where the warm-started policy is saved (None: output_dir/name/warm_start). A folder
    that already holds one made with the same settings is reused (a resumed run does);
    one made with other settings is refused."""

    def __post_init__(self) -> None:
        check_fields(self)  # types first: the checks below compare numbers
        for name in ("epochs", "batch_size", "micro_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"warm_start.{name} must be >= 1, got {getattr(self, name)}")
        if self.questions < 0:
            raise ValueError(f"warm_start.questions must be >= 0 (0: all), got {self.questions}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"warm_start.lr must be a positive finite number, got {self.lr}")
        if not 0.0 <= self.detours <= 1.0:
            raise ValueError(f"warm_start.detours must lie in [0, 1], got {self.detours}")
        if self.hops is not None and (not self.hops or min(self.hops) < 1):
            raise ValueError(
                f"warm_start.hops lists hop counts >= 1 (e.g. [1]), or is null for any; got "
                f"{list(self.hops)}"
            )


def demonstrated(questions: Sequence[Mapping[str, Any]] | int, cfg: WarmStartConfig) -> list[int]:
    """Positions, in order, of the training questions the warm-start demonstrates: those
    of ``cfg.hops`` (all without it), or ``cfg.questions`` of them drawn with ``cfg.seed``.
    ``questions`` may be their number when ``cfg.hops`` is None."""
    if isinstance(questions, int):
        if cfg.hops is not None:
            raise TypeError("demonstrated needs the questions (not their number) with hops")
        eligible = list(range(questions))
    elif cfg.hops is None:
        eligible = list(range(len(questions)))
    else:
        eligible = [i for i, q in enumerate(questions) if q.get("hops") in cfg.hops]
        if not eligible:
            raise InputError(
                f"warm_start.hops={list(cfg.hops)}: no training question has those hops "
                f"(they have {sorted({q.get('hops') for q in questions}, key=str)})"
            )
    if not cfg.questions or cfg.questions >= len(eligible):
        return eligible
    pick = np.random.default_rng(cfg.seed).choice(len(eligible), cfg.questions, replace=False)
    return sorted(eligible[int(i)] for i in pick)


def rl_questions(questions: Sequence[Mapping[str, Any]], cfg: WarmStartConfig) -> list:
    """The training questions RL draws from after a warm-start of ``cfg``: every one, or
    (``cfg.rl_questions == "undemonstrated"``) those the warm-start does not demonstrate.
    Raises InputError when that leaves none."""
    if not cfg.enabled or cfg.rl_questions == "all":
        return list(questions)
    shown = set(demonstrated(questions, cfg))
    rest = [q for i, q in enumerate(questions) if i not in shown]
    if not rest:
        raise InputError(
            f"warm_start.questions={cfg.questions} demonstrates all {len(questions)} training "
            "questions, which leaves none for RL under warm_start.rl_questions="
            f"'undemonstrated'; give warm_start.questions below {len(questions)}, or set "
            "warm_start.rl_questions=all to train RL on the demonstrated questions too"
        )
    return rest


# ----------------------------------------------------------------------- the expert
def _action(kind: str, text: str, style: str) -> str:
    if kind == "answer":
        return f"<answer> {text} </answer>"
    if style == "tool_call":
        return (
            f"<tool_call>{json.dumps({'name': 'search', 'arguments': {'query': text}})}</tool_call>"
        )
    return f"<search> {text} </search>"


def expert_turns(
    question: Mapping[str, Any],
    titles: Mapping[str, str],
    gen: Any,
    *,
    detour: str | None = None,
) -> list[str]:
    """What the expert writes at each turn of ``question`` (the text after whatever prefix
    the generator feeds that turn: ``response_prefix`` on turn 0, ``final_turn_prefix`` on
    the last allowed one). It searches each supporting document's title, as many as fit
    before the answer turn, then ``detour`` (a title it does not need) when a turn is
    left, then answers the first gold answer.

    Raises ``ValueError`` when the question has no ``supporting_doc_ids``, a document id
    is not in the corpus, or a prefix is not the start of the action the expert takes.
    """
    ids = question.get("supporting_doc_ids")
    if not ids:
        raise InputError(
            f"warm_start needs supporting_doc_ids to demonstrate a question, and "
            f"{question.get('question', '')[:60]!r} has none (the synthetic world has them; "
            "for other data, turn the warm-start off or add them)"
        )
    missing = [i for i in ids if str(i) not in titles]
    if missing:
        raise InputError(f"supporting documents {missing} of a question are not in the corpus")
    searches = [titles[str(i)] for i in ids][: gen.max_turns - 1]
    if detour is not None and _turn_to_spare(question, gen):
        searches.append(detour)
    actions = [("search", s) for s in searches] + [("answer", question["golden_answers"][0])]
    turns = []
    for turn, (kind, text) in enumerate(actions):
        prefix = gen.response_prefix if turn == 0 else ""
        if turn == gen.max_turns - 1:
            prefix += gen.final_turn_prefix
        action = _action(kind, text, gen.action_style)
        if not action.startswith(prefix):
            raise InputError(
                f"the warm-start's expert writes {action!r} at turn {turn}, but the generator "
                f"feeds {prefix!r} before that turn; the demonstrations need prefixes that "
                "begin an action (e.g. response_prefix '<search>', final_turn_prefix "
                "'<answer>') or none"
            )
        turns.append(action[len(prefix) :])
    return turns


def _turn_to_spare(question: Mapping[str, Any], gen: Any) -> bool:
    """Whether the expert's searches of ``question`` leave a turn before the answer."""
    return len(question.get("supporting_doc_ids") or ()) < gen.max_turns - 1


class ScriptedSampler:
    """A :class:`~ray_credit.actors.sampling.Sampler` that writes given turns instead of
    sampling: each context is recognised by the prompt it starts with (:meth:`add`), and
    gets the next turn of that prompt's script (log-probs 0: nothing was sampled)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self._scripts: dict[tuple[int, ...], list[str]] = {}
        self._next: dict[tuple[int, ...], int] = {}
        self._lengths: list[int] = []

    def add(self, prompt_ids: Sequence[int], turns: Sequence[str]) -> None:
        """Script the turns written after ``prompt_ids``, one per :meth:`sample` call."""
        key = tuple(prompt_ids)
        if key in self._scripts:
            raise ValueError("two scripts share a prompt (a question given twice?)")
        self._scripts[key], self._next[key] = list(turns), 0
        self._lengths = sorted({*self._lengths, len(key)})

    def _key(self, context: Sequence[int]) -> tuple[int, ...]:
        for n in self._lengths:
            key = tuple(context[:n])
            if key in self._scripts:
                return key
        raise KeyError("a context starts with no scripted prompt")

    def sample(
        self, contexts: Sequence[Sequence[int]], params: SamplingParams, *, seed: int
    ) -> list[SampledTurn]:
        out = []
        for context in contexts:
            key = self._key(context)
            script, turn = self._scripts[key], self._next[key]
            if turn >= len(script):
                raise RuntimeError(f"a prompt's script has {len(script)} turns; turn {turn} asked")
            self._next[key] += 1
            ids = list(self.tokenizer(script[turn], add_special_tokens=False)["input_ids"])
            hit = len(ids) > params.max_new_tokens
            ids = ids[: params.max_new_tokens]
            out.append(SampledTurn(ids, [0.0] * len(ids), hit))
        return out

    def load_weights(self, weights: Mapping[str, Any]) -> None:
        raise TypeError("a ScriptedSampler has no weights")


def demonstrate(
    questions: Sequence[Mapping[str, Any]],
    titles: Mapping[str, str],
    tokenizer: Any,
    retriever: Any,
    gen: Any,
    *,
    detours: float = 0.0,
    seed: int = 0,
) -> tuple[TrajectoryBatch, dict[str, float]]:
    """One expert demonstration per question through the generator's loop (``gen``: its
    :class:`~ray_credit.actors.generator.GeneratorConfig`), and the counts: the
    demonstrations kept (a gold answer was in an observation, and the answer is right)
    and those left out. A share ``detours`` of those with a turn to spare search one
    unneeded title of ``titles`` first (:attr:`WarmStartConfig.detours`)."""
    from ray_credit.actors.generator import Generator

    rng = np.random.default_rng(seed)
    pool = sorted(set(titles.values()))
    expert = ScriptedSampler(tokenizer)
    generator = Generator(retriever=retriever, config=gen, sampler=expert, name="demo")
    took = []
    for q in questions:
        detour = None
        if _turn_to_spare(q, gen) and rng.random() < detours:
            needed = {titles.get(str(i)) for i in q.get("supporting_doc_ids") or ()}
            others = [t for t in pool if t not in needed]
            detour = others[rng.integers(len(others))] if others else None
        took.append(detour is not None)
        expert.add(
            generator.prompt_ids(q["question"], q.get("prompt")),
            expert_turns(q, titles, gen, detour=detour),
        )
    batch = generator.generate(questions, group_size=1)
    # Each turn's weight in the cross-entropy: 1, and 0 on a detour's search, which is
    # shown (its document stays in the context) but not taught (its title is random).
    position = batch.turn_position
    weight = np.ones(batch.num_turns, dtype=np.float32)
    detoured = np.repeat(np.asarray(took, dtype=bool), batch.turn_counts)
    weight[detoured & (position == batch.turn_counts[batch.turn_traj_index] - 2)] = 0.0
    batch = batch.with_turn_columns({"turn_advantages": weight})
    found = batch.turn_values("turn_contains_gold", null=False)
    per_traj = np.logical_or.reduceat(found, batch.turn_offsets[:-1]) if len(found) else found
    keep = per_traj & (batch.traj_values("outcome_reward") >= 1.0)
    kept = batch.select(np.flatnonzero(keep))
    counts = {
        "warm_start/demonstrations": float(keep.sum()),
        "warm_start/detours": float(np.sum(took)),
        "warm_start/left_out_no_gold_seen": float((~per_traj).sum()),
        "warm_start/left_out_wrong_answer": float((per_traj & ~keep).sum()),
        "warm_start/expert_tokens": float(_trained(kept.to_torch()).sum()),
        "warm_start/tokens": float(len(kept.token_values("loss_mask"))),
    }
    return kept, counts


def settings_fingerprint(settings: Mapping[str, Any]) -> str:
    """A short stable hash of JSON-able ``settings`` (key order does not matter)."""
    blob = json.dumps(settings, sort_keys=True, default=str).encode()
    return hashlib.blake2b(blob, digest_size=10).hexdigest()


def weights_digest(folder: str | Path) -> str:
    """The SHA-256 of a saved policy's weights (its ``*.safetensors`` files, by name and
    content): the same settings made again on another CPU or torch build can give other
    weights, and runs that claim one start must have started from the same ones."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no *.safetensors weights to digest")
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0")
        with file.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


# ----------------------------------------------------------------------- fine-tuning


def _trained(tensors: Mapping[str, Any]) -> Any:
    """The expert's tokens that are taught: ``loss_mask`` times their turn's weight
    (``turn_advantages``: 0 on a detour's search)."""
    return tensors["loss_mask"] * tensors["advantages"]


def _finetune(
    model: Any, batch: TrajectoryBatch, cfg: WarmStartConfig, pad: int, device: str
) -> dict:
    """Token-mean cross-entropy on the expert's tokens; returns the loss per epoch."""
    import torch

    from ray_credit.actors.learner import autocast, micro_batches, token_logprobs, trained_span

    tensors = batch.to_torch(pad_token_id=pad)
    ids, attention = tensors["input_ids"], tensors["attention_mask"]
    mask = _trained(tensors)[:, 1:]
    lengths = attention.sum(-1)
    n = len(batch)
    steps_per_epoch = math.ceil(n / cfg.batch_size)
    total = steps_per_epoch * cfg.epochs
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / total)
    rng = np.random.default_rng(cfg.seed)
    losses = []
    for _ in range(cfg.epochs):
        epoch_loss, epoch_tokens = 0.0, 0.0
        order = rng.permutation(n)
        for rows in np.array_split(order, steps_per_epoch):
            tokens = float(mask[rows].sum())
            optimizer.zero_grad(set_to_none=True)
            for positions in micro_batches(lengths[rows].numpy(), cfg.micro_batch_tokens):
                part = rows[positions]
                width = int(lengths[part].max())
                span = trained_span(mask[part], width)
                with autocast(device, cfg.autocast):
                    out = model(
                        input_ids=ids[part, :width].to(device),
                        attention_mask=attention[part, :width].to(device),
                        logits_to_keep=width - span.start,
                    )
                target = ids[part, span.start + 1 : width].to(device)
                nll = -token_logprobs(out.logits[:, :-1], target)
                m = mask[part, span].to(device)
                loss = (nll * m).sum() / max(tokens, 1.0)
                loss.backward()
                epoch_loss += float((nll.detach() * m).sum())
            epoch_tokens += tokens
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
        losses.append(epoch_loss / max(epoch_tokens, 1.0))
    return {"loss_per_epoch": losses, "optimizer_steps": total}


def _fit_here(model: str, cfg: WarmStartConfig, device: str, demos: TrajectoryBatch,
              pad: int, out: Path, fingerprint: str) -> dict:  # fmt: skip
    """The fine-tuning in this process (no Ray): the policy saved in ``out``."""
    from ray_credit.models import load_model

    policy, _ = load_model(model, device=device)
    result = _finetune(policy, demos, cfg, pad, device)
    policy.save_pretrained(out)
    return result


def warm_start(
    model: str,
    questions: Sequence[Mapping[str, Any]],
    titles: Mapping[str, str],
    retriever: Any,
    gen: Any,
    cfg: WarmStartConfig,
    folder: str,
    *,
    device: str = "cpu",
    fit: Callable[[TrajectoryBatch, int, Path, str], dict] | None = None,
) -> dict[str, Any]:
    """Demonstrate ``questions``, fine-tune ``model`` on them and save it in ``folder``
    (a Hugging Face folder, with ``warm_start.json``: the settings' fingerprint, the
    weights' SHA-256 and the metrics). A folder already holding a warm start of the same
    settings is reused as it is (its weights checked against the SHA-256 it saved); one
    of other settings raises. Returns the manifest.

    ``fit(demonstrations, pad_token_id, folder, fingerprint)`` fine-tunes and saves the
    policy in ``folder``, returning ``loss_per_epoch`` and ``optimizer_steps`` (the
    fingerprint names the settings, for a job's checkpoints): a pipeline passes a
    Ray Train job (:func:`ray_credit.sft.fine_tune`); None fine-tunes here, on
    ``device``."""
    from ray_credit.models import load_tokenizer

    # where it is saved and what RL does after it are not how it is made
    made_with = {k: v for k, v in asdict(cfg).items() if k not in ("folder", "rl_questions")}
    if made_with["hops"] is None:  # the fingerprint of a warm-start made before the setting
        del made_with["hops"]
    else:
        made_with["hops"] = sorted(set(made_with["hops"]))  # a set of hop counts: [2, 1] is [1, 2]
    protocol = {k: getattr(gen, k) for k in _PROTOCOL_FIELDS}
    settings = {"model": model, "warm_start": made_with, "generator": protocol,
                "questions": [q["question"] for q in questions],
                "demonstrations": _DEMONSTRATION_FORMAT}  # fmt: skip
    fingerprint = settings_fingerprint(settings)
    path = Path(folder)
    manifest_path = path / _MANIFEST
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("fingerprint") != fingerprint:
            raise ValueError(
                f"{path} holds a warm-started policy made with other settings (model, "
                "warm_start, generator or questions); delete it or set warm_start.folder"
            )
        on_disk = weights_digest(path)  # the weights the run will load, not only the note
        if manifest.setdefault("weights_sha256", on_disk) != on_disk:  # (older: no note)
            raise ValueError(
                f"{path}: its weights are not those its warm-start saved (SHA-256 "
                f"{on_disk[:12]}..., saved {manifest['weights_sha256'][:12]}...); bring the "
                "whole folder as it was saved, or delete it to make the warm-start again"
            )
        return {**manifest, "reused": True}
    if path.exists() and any(path.iterdir()):
        raise ValueError(
            f"{path} exists and holds no warm start (no {_MANIFEST}); empty it or set "
            "warm_start.folder to a new folder"
        )
    start = time.perf_counter()
    chosen = [questions[i] for i in demonstrated(questions, cfg)]
    tokenizer = load_tokenizer(model)
    demos, counts = demonstrate(
        chosen, titles, tokenizer, retriever, gen, detours=cfg.detours, seed=cfg.seed
    )
    if len(demos) == 0:
        raise RuntimeError(
            f"none of the {len(chosen)} demonstrations saw a gold answer in its observations "
            "(check the retriever, topk and max_turns)"
        )
    made = time.perf_counter()
    tmp = path.with_name(path.name + ".partial")  # ours alone: an interrupted save's
    if tmp.exists():
        shutil.rmtree(tmp)
    fit = fit or functools.partial(_fit_here, model, cfg, device)
    result = fit(demos, int(tokenizer.pad_token_id), tmp, fingerprint)
    tokenizer.save_pretrained(tmp)
    manifest = {
        "fingerprint": fingerprint,
        "weights_sha256": weights_digest(tmp),
        "metrics": {
            **counts,
            "warm_start/questions": float(len(chosen)),
            "warm_start/loss_first_epoch": result["loss_per_epoch"][0],
            "warm_start/loss_last_epoch": result["loss_per_epoch"][-1],
            "warm_start/optimizer_steps": float(result["optimizer_steps"]),
            "warm_start/resumed_epoch": float(result.get("resumed_epoch", 0)),
            "warm_start/demonstrate_seconds": made - start,
            "warm_start/train_seconds": time.perf_counter() - made,
        },
        "loss_per_epoch": result["loss_per_epoch"],
    }
    (tmp / _MANIFEST).write_text(json.dumps(manifest, indent=2))
    if path.exists():
        path.rmdir()  # empty (checked above)
    tmp.rename(path)  # a folder with a manifest is whole: a crash before here leaves none
    return {**manifest, "reused": False}
