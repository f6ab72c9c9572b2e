"""Token samplers: the generator's backends. One call samples one turn for many contexts.

A sampler takes token-id contexts and returns, per context, exactly the ids it sampled,
the behavior log-probability of each, and whether it stopped at the token limit. Nothing
is re-tokenized: the ids returned are the ids the learner trains on.

Behavior log-probabilities are ``log_softmax(logits / temperature)`` at the sampled token
(greedy decoding: temperature 1), before top-k / top-p truncation: the distribution the
learner recomputes from the same logits, so the importance ratio compares like with like
(verl and vLLM's default raw log-probs do the same).

* :class:`TransformersSampler`: any HF causal LM on CPU or GPU; a batched decode loop with
  a KV cache over left-padded contexts, finished rows dropped from the batch as they stop.
* :class:`VLLMSampler`: vLLM's offline ``LLM`` engine with token prompts; weights updated
  in place through ``LLM.collective_rpc``. It needs a GPU and ``pip install vllm``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ray_credit.models import load_weights_checked

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["SampledTurn", "Sampler", "SamplingParams", "TransformersSampler", "VLLMSampler"]


@dataclass(frozen=True)
class SamplingParams:
    """How one turn is sampled."""

    max_new_tokens: int = 256
    """Token limit of one turn; a turn that reaches it is marked ``hit_limit``."""
    temperature: float = 1.0
    """Softmax temperature; 0 is greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling mass (1: off)."""
    top_k: int = 0
    """Keep the k most likely tokens (0: off)."""
    stop: tuple[str, ...] = ("</search>", "</answer>")
    """A turn ends right after the first token that completes one of these strings."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")


@dataclass(frozen=True)
class SampledTurn:
    """What one context produced in one turn."""

    token_ids: list[int]
    logprobs: list[float]
    hit_limit: bool
    """True when the turn stopped at ``max_new_tokens`` (no eos, no stop string)."""


class Sampler(Protocol):
    """What the generator needs from a backend."""

    eos_token_id: int
    tokenizer: Any

    def sample(
        self, contexts: Sequence[Sequence[int]], params: SamplingParams, *, seed: int
    ) -> list[SampledTurn]: ...

    def load_weights(self, weights: Mapping[str, Any]) -> None: ...


class TransformersSampler:
    """Batched sampling with a Hugging Face causal LM (CPU or GPU).

    Contexts are left-padded into micro-batches of at most ``max_batch_size`` rows; each
    decode step feeds one token per live row through the KV cache, and rows that stop are
    dropped from the batch and the cache (``DynamicCache.batch_select_indices``).
    """

    def __init__(self, model: Any, tokenizer: Any, *, max_batch_size: int = 64):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.eos_token_id = int(tokenizer.eos_token_id)
        self.pad_token_id = int(tokenizer.pad_token_id)
        # Tokens whose text holds the last character of a stop string: only after one of
        # them can a stop string have completed, so only then is the tail decoded.
        self._stop_cache: dict[tuple[str, ...], tuple[set[int], int]] = {}

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def load_weights(self, weights: Mapping[str, Any]) -> None:
        load_weights_checked(self.model, weights)

    def sample(
        self, contexts: Sequence[Sequence[int]], params: SamplingParams, *, seed: int
    ) -> list[SampledTurn]:
        import torch

        generator = torch.Generator(device=self.device).manual_seed(seed)
        out: list[SampledTurn] = []
        for start in range(0, len(contexts), self.max_batch_size):
            chunk = contexts[start : start + self.max_batch_size]
            out.extend(self._sample_chunk(chunk, params, generator))
        return out

    def _stop_tokens(self, stop: tuple[str, ...]) -> tuple[set[int], int]:
        if stop not in self._stop_cache:
            last_chars = {s[-1] for s in stop}
            vocab = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
            ids = {
                i for i, piece in enumerate(vocab) if piece and any(c in piece for c in last_chars)
            }
            self._stop_cache[stop] = (ids, max((len(s) for s in stop), default=0))
        return self._stop_cache[stop]

    def _sample_chunk(self, contexts, params: SamplingParams, generator) -> list[SampledTurn]:
        import torch
        from transformers import DynamicCache

        device = self.device
        rows, width = len(contexts), max(len(c) for c in contexts)
        input_ids = torch.full((rows, width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((rows, width), dtype=torch.long)
        for i, ctx in enumerate(contexts):  # left padding: every row ends at the last column
            input_ids[i, width - len(ctx) :] = torch.as_tensor(ctx, dtype=torch.long)
            attention[i, width - len(ctx) :] = 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        stop_ids, stop_chars = self._stop_tokens(params.stop)

        tokens: list[list[int]] = [[] for _ in range(rows)]
        logprobs: list[list[float]] = [[] for _ in range(rows)]
        hit_limit = [False] * rows
        live = list(range(rows))  # original row of each batch row
        cache = DynamicCache()
        with torch.inference_mode():
            logits = self.model(
                input_ids=input_ids,
                attention_mask=attention,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1, :]
            for step in range(params.max_new_tokens):
                chosen, chosen_logprob = _pick(logits.float(), params, generator)
                keep = []
                for b, row in enumerate(live):
                    token = int(chosen[b])
                    tokens[row].append(token)
                    logprobs[row].append(float(chosen_logprob[b]))
                    if token == self.eos_token_id:
                        continue
                    if token in stop_ids and self._ends_with_stop(
                        tokens[row], params.stop, stop_chars
                    ):
                        continue
                    if step == params.max_new_tokens - 1:
                        hit_limit[row] = True
                        continue
                    keep.append(b)
                if not keep:
                    break
                if len(keep) < len(live):
                    index = torch.as_tensor(keep, device=device)
                    cache.batch_select_indices(index)
                    attention, positions, chosen = attention[index], positions[index], chosen[index]
                    live = [live[b] for b in keep]
                attention = torch.cat([attention, attention.new_ones((len(live), 1))], dim=1)
                positions = positions[:, -1:] + 1
                logits = self.model(
                    input_ids=chosen[:, None],
                    attention_mask=attention,
                    position_ids=positions,
                    past_key_values=cache,
                    use_cache=True,
                ).logits[:, -1, :]
        return [SampledTurn(tokens[r], logprobs[r], hit_limit[r]) for r in range(rows)]

    def _ends_with_stop(self, ids: list[int], stop: tuple[str, ...], chars: int) -> bool:
        # A stop string of n characters spans at most n tokens: decode only that tail.
        tail = self.tokenizer.decode(ids[-chars:], skip_special_tokens=False)
        return any(s in tail for s in stop)


def _pick(
    logits: torch.Tensor, params: SamplingParams, generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return it and its behavior log-prob (see module docs)."""
    import torch

    if params.temperature == 0:
        chosen = logits.argmax(dim=-1)
        logp = torch.log_softmax(logits, dim=-1)
        return chosen, logp.gather(-1, chosen[:, None])[:, 0]
    scaled = logits / params.temperature
    logp = torch.log_softmax(scaled, dim=-1)
    filtered = scaled
    if params.top_k and params.top_k < filtered.shape[-1]:
        kth = torch.topk(filtered, params.top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(filtered, descending=True, dim=-1)
        mass = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
        drop = mass - torch.softmax(ordered, dim=-1) > params.top_p  # keep the token crossing p
        ordered = ordered.masked_fill(drop, float("-inf"))
        filtered = torch.full_like(filtered, float("-inf")).scatter(-1, order, ordered)
    chosen = torch.multinomial(torch.softmax(filtered, dim=-1), 1, generator=generator)[:, 0]
    return chosen, logp.gather(-1, chosen[:, None])[:, 0]


class VLLMSampler:
    """vLLM's offline engine as a sampler (GPU only; ``pip install vllm``).

    Written against vLLM's documented API: ``LLM(model=..., worker_extension_cls=...)``,
    ``LLM.generate`` with ``TokensPrompt`` inputs and ``SamplingParams(logprobs=0)`` (the
    sampled token's log-prob), and ``LLM.collective_rpc`` to call
    :class:`ray_credit.actors.vllm_worker.WeightUpdateExtension` on every worker for
    weight updates. Stop strings are kept in the output, so the ids returned are the ids
    sampled.
    """

    def __init__(self, model: str, *, seed: int = 0, **engine_kwargs: Any):
        try:
            import vllm
        except ImportError as err:
            raise ImportError(
                "the vllm backend needs vLLM: `pip install ray-credit[vllm]` on a GPU machine, "
                "or use backend='transformers'"
            ) from err
        self._vllm = vllm
        self.llm = vllm.LLM(
            model=model,
            seed=seed,
            worker_extension_cls="ray_credit.actors.vllm_worker.WeightUpdateExtension",
            **engine_kwargs,
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.eos_token_id = int(self.tokenizer.eos_token_id)

    def load_weights(self, weights: Mapping[str, Any]) -> None:
        self.llm.collective_rpc("load_named_weights", args=(dict(weights),))

    def sample(
        self, contexts: Sequence[Sequence[int]], params: SamplingParams, *, seed: int
    ) -> list[SampledTurn]:
        vllm = self._vllm
        sampling = vllm.SamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            max_tokens=params.max_new_tokens,
            stop=list(params.stop),
            include_stop_str_in_output=True,
            logprobs=0,
            seed=seed,
        )
        prompts = [vllm.inputs.TokensPrompt(prompt_token_ids=list(c)) for c in contexts]
        outputs = self.llm.generate(prompts, sampling, use_tqdm=False)
        turns = []
        for output in outputs:
            completion = output.outputs[0]
            ids = list(completion.token_ids)
            logprobs = [
                float(step[token].logprob)
                for token, step in zip(ids, completion.logprobs, strict=True)
            ]
            turns.append(SampledTurn(ids, logprobs, completion.finish_reason == "length"))
        return turns
