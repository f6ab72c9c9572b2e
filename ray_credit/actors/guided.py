"""Guided decoding: a local judge's reply in exactly the form its signal asks for.

A small (or untrained) model rarely writes valid JSON on its own, and every malformed
reply is a null judgement. Here the reply is built field by field from the signal's
:data:`~ray_credit.signals._reply.ReplySchema`, and the model decides only what the
schema leaves open:

* literal text (braces, quotes, field names, ``", "`` and ``": "``) is forced, so the
  reply reads like ``json.dumps`` of the judgement;
* a :class:`~ray_credit.signals._reply.Choice` or :class:`~ray_credit.signals._reply.Count`
  is the allowed value whose text, followed by the literal that must come next (``,`` or
  ``}``), has the highest total log-probability after the reply so far (teacher-forced;
  the first value wins a tie). The follower keeps a value from winning by being short:
  ``1,`` competes with ``10,``, so the model must also say the number ends there. A count
  ranges over ``0..bound``, the bound being its ``max`` or the value of the earlier field
  it is ``at_most``;
* a :class:`~ray_credit.signals._reply.Strings` list: each string is generated greedily
  from the tokens that cannot break a JSON string (no quote, backslash or control
  character), its first token holding a non-space character. A closing token (``"``, or
  one the model would naturally write at a string's end, such as ``",`` or ``"]``) is one
  more candidate at every later step: the string ends when one of them is the argmax, or
  after ``max_tokens``. Then continuing the list (``,``) or closing it (``]``), one
  character each, is chosen like a value, within ``min_items..max_items``.

Token boundaries: the reply so far is re-encoded (``add_special_tokens=False``) after the
context ids at every slot, so the model sees the text's natural tokenization rather than
the pieces it was assembled from. A candidate is scored from the first token where any of
the row's candidates departs from that encoding, so when a candidate merges with the end
of the text (``"`` + ``, "`` is ``",`` + `` "``) all are scored from the same point and
their totals compare fairly. Inside a string the model's own tokens are kept.

Batching: rows are decoded in chunks of ``max_batch_rows`` (shortest contexts first).
A chunk's contexts go through the model once; their KV cache is kept, and every later
pass feeds only reply tokens after a copy of it, so a slot costs the reply's length, not
the prompt's (a Search-P1 reply has six value slots, one a ``Count`` with 13 candidates).
At a value slot, every candidate of every row at a Choice or Count is one sequence (the
reply's tokens with the candidate), and they share forward passes of at most
``max_batch_rows`` sequences, left-padded, with position ids from the attention mask.
Strings are generated for the chunk's rows at once, token by token with the KV cache.
Everything is argmax, so replies are deterministic and (but for floating-point noise in a
near-tie) independent of batching.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ray_credit.signals._reply import Choice, Count, ReplySchema, Strings, count_bound, render_value

__all__ = ["guided_replies"]

# A token text that cannot sit inside a JSON string as is (``\ufffd``: part of a
# multi-byte character, whose other bytes a later token might never supply).
_UNSAFE = re.compile('["\\\\\x00-\x1f\x7f\ufffd]')
# A token that ends a string: the quote, possibly with the list's next punctuation.
_CLOSER = re.compile(r'"[ ,\]}]*')
_CONTINUE, _CLOSE = ', "', "]"
# id(tokenizer) -> (tokenizer, (content, first, closer) masks); the tokenizer is kept so
# that its id cannot be reused by another one.
_VOCAB_MASKS: dict[int, tuple[Any, tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}


def guided_replies(
    model: Any,
    tokenizer: Any,
    contexts: Sequence[Sequence[int]],
    schemas: Sequence[ReplySchema],
    *,
    max_batch_rows: int = 64,
) -> list[str]:
    """The reply to each context in the form of its schema (module docstring).

    Args:
        model: a Hugging Face causal LM; it runs on its own device, as it is (eval mode).
        tokenizer: its tokenizer.
        contexts: the token ids of each rendered prompt (chat template and generation
            prompt applied).
        schemas: one reply schema per context.
        max_batch_rows: contexts decoded together, and sequences per forward pass; it
            bounds memory (at the peak, about three KV caches of that many contexts).

    Returns:
        Per context, ``{"field": value, ...}`` with the schema's fields in order, which
        ``json.loads`` reads back.
    """
    import torch

    _check(contexts, schemas, max_batch_rows)
    rows = [_Row(list(c), tuple(s)) for c, s in zip(contexts, schemas, strict=True)]
    order = sorted(range(len(rows)), key=lambda i: len(rows[i].context))
    with torch.inference_mode():
        for lo in range(0, len(order), max_batch_rows):
            chunk = [rows[i] for i in order[lo : lo + max_batch_rows]]
            _Chunk(model, tokenizer, chunk, max_batch_rows).decode()
    return [r.text for r in rows]


def _check(
    contexts: Sequence[Sequence[int]], schemas: Sequence[ReplySchema], max_batch_rows: int
) -> None:
    """Refuse bad input before any model work, saying what to pass instead."""
    if max_batch_rows < 1:
        raise ValueError(f"max_batch_rows must be >= 1, got {max_batch_rows}")
    if len(contexts) != len(schemas):
        raise ValueError(
            f"pass one schema per context: got {len(contexts)} contexts and {len(schemas)} schemas"
        )
    for i, (context, schema) in enumerate(zip(contexts, schemas, strict=True)):
        if not len(context):
            raise ValueError(f"context {i} is empty: pass the rendered prompt's token ids")
        if not schema:
            raise ValueError(f"schema {i} is empty: a reply schema needs at least one field")
        seen: set[str] = set()
        integers: set[str] = set()  # earlier fields whose value is an integer
        for name, kind in schema:
            if not isinstance(kind, Choice | Count | Strings):
                raise TypeError(f"field {name!r}: {kind!r} is not a Choice, Count or Strings")
            if name in seen:
                raise ValueError(f"schema {i} repeats the field {name!r}; names must be unique")
            seen.add(name)
            if (
                isinstance(kind, Count)
                and kind.at_most is not None
                and kind.at_most not in integers
            ):
                raise ValueError(
                    f"field {name!r}: at_most={kind.at_most!r} must name an earlier Count "
                    "(or a Choice of integers) in the same schema"
                )
            if isinstance(kind, Count) or (
                isinstance(kind, Choice) and all(type(v) is int for v in kind.values)
            ):
                integers.add(name)


@dataclass
class _Row:
    """One reply under construction: its text so far and the field being written."""

    context: list[int]
    schema: ReplySchema
    text: str = "{"
    position: int = 0  # index of the field being written
    values: dict[str, Any] = field(default_factory=dict)  # what a later at_most reads
    items: int = 0  # strings written in the current list

    def __post_init__(self) -> None:
        self._open_field()

    @property
    def done(self) -> bool:
        return self.position == len(self.schema)

    @property
    def kind(self) -> Choice | Count | Strings:
        return self.schema[self.position][1]

    def options(self) -> list[Any]:
        """The allowed values of the current Choice or Count field."""
        if isinstance(self.kind, Choice):
            return list(self.kind.values)
        return list(range(count_bound(self.kind, self.values) + 1))

    def follower(self) -> str:
        """The literal after the current field's value: the next field's comma, or the
        closing brace."""
        return "," if self.position + 1 < len(self.schema) else "}"

    def write_value(self, value: Any) -> None:
        self.text += render_value(value)
        self._close_field(value)

    def end_string(self, content: str) -> bool:
        """Close a string; continue the list when it must, close it when it must. True
        when the list may either go on or stop: the model's call."""
        self.text += content + '"'
        self.items += 1
        if self.items < self.kind.min_items:
            self.text += _CONTINUE
        elif self.items >= self.kind.max_items:
            self.end_list()
        else:
            return True
        return False

    def end_list(self) -> None:
        self.text += _CLOSE
        self._close_field(None)

    def _open_field(self) -> None:
        name, kind = self.schema[self.position]
        self.text += ("" if self.position == 0 else ", ") + json.dumps(name) + ": "
        if isinstance(kind, Strings):
            self.text += '["'
            self.items = 0

    def _close_field(self, value: Any) -> None:
        self.values[self.schema[self.position][0]] = value
        self.position += 1
        if self.done:
            self.text += "}"
        else:
            self._open_field()


@dataclass
class _Unit:
    """Candidates of one row scored after one shared prefix."""

    row: int
    prefix: list[int]  # the context's last token and the reply's shared tokens
    suffixes: list[list[int]]  # each candidate's tokens after the prefix (never empty)


class _Chunk:
    """Rows decoded together over one KV cache of their contexts.

    The cache holds each context but its last token; every pass feeds that token again,
    then reply tokens, so even a reply's first token is predicted within the pass."""

    def __init__(self, model: Any, tokenizer: Any, rows: list[_Row], max_rows: int) -> None:
        self.model, self.tokenizer, self.rows, self.max_rows = model, tokenizer, rows, max_rows
        self.device = next(model.parameters()).device
        self.pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        ids, self.mask = self._left_pad([row.context[:-1] for row in rows])
        self.lengths = self.mask.sum(-1)  # each context's cached tokens
        self.cache = None
        if ids.shape[1]:
            positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
            self.cache = model(
                input_ids=ids,
                attention_mask=self.mask,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
            ).past_key_values

    def decode(self) -> None:
        while pending := [i for i, row in enumerate(self.rows) if not row.done]:
            values = [i for i in pending if not isinstance(self.rows[i].kind, Strings)]
            if values:
                self.choose_values(values)
            pending = [i for i in pending if not self.rows[i].done]  # a value may end a row
            strings = [i for i in pending if isinstance(self.rows[i].kind, Strings)]
            if strings:
                self.write_strings(strings)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # ------------------------------------------------------------------ values
    def choose_values(self, rows: list[int]) -> None:
        """Every given row's current Choice / Count field: its most likely allowed value."""
        options = [self.rows[i].options() for i in rows]
        # Each value is scored with the literal that must follow it, so that "1" cannot
        # win over "10" just by being shorter: "1," against "10,".
        asks = [
            (i, [render_value(v) + self.rows[i].follower() for v in o])
            for i, o in zip(rows, options, strict=True)
        ]
        scores = self.score(asks)
        for i, values, score in zip(rows, options, scores, strict=True):
            self.rows[i].write_value(values[int(np.argmax(score))])  # argmax: first of a tie

    def score(self, asks: list[tuple[int, list[str]]]) -> list[np.ndarray]:
        """Log-probability of each candidate text after each row's reply so far, counted
        from the first token where the row's candidates depart from the reply's own
        encoding (module docstring); comparable within a row."""
        units = []
        for i, candidates in asks:
            row = self.rows[i]
            base = self.encode(row.text)
            full = [self.encode(row.text + c) for c in candidates]
            k = min(_common_prefix(base, f) for f in full)
            prefix = row.context[-1:] + base[:k]
            for lo in range(0, len(full), self.max_rows):
                units.append(_Unit(i, prefix, [f[k:] for f in full[lo : lo + self.max_rows]]))
        totals = np.array([t for group in _pack(units, self.max_rows) for t in self._score(group)])
        sizes = np.cumsum([0] + [len(c) for _, c in asks])
        return [totals[a:b] for a, b in zip(sizes[:-1], sizes[1:], strict=True)]

    def _score(self, group: list[_Unit]) -> list[float]:
        """The candidates' totals: one pass over the units' prefixes, whose last logits
        score each candidate's first token; then, with that cache copied once per
        candidate, one pass over the candidates' other tokens."""
        import torch

        out, mask, start = self._extend([u.row for u in group], [u.prefix for u in group])
        first = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
        owner = [g for g, u in enumerate(group) for _ in u.suffixes]
        suffixes = [s for u in group for s in u.suffixes]
        totals = first[owner, [s[0] for s in suffixes]]
        width = max(len(s) for s in suffixes) - 1
        if width:
            inputs = torch.full((len(suffixes), width), self.pad, dtype=torch.long)
            targets, valid = torch.zeros_like(inputs), torch.zeros_like(inputs)
            for b, s in enumerate(suffixes):  # right-padded: input t predicts target t
                inputs[b, : len(s) - 1] = torch.as_tensor(s[:-1])
                targets[b, : len(s) - 1] = torch.as_tensor(s[1:])
                valid[b, : len(s) - 1] = 1
            inputs, targets, valid = (t.to(self.device) for t in (inputs, targets, valid))
            index = torch.as_tensor(owner, device=self.device)
            cache = out.past_key_values  # this pass's own copy: free to reorder
            cache.reorder_cache(index)
            logits = self.model(
                input_ids=inputs,
                attention_mask=torch.cat([mask[index], valid], dim=1),
                position_ids=start[index, None] + torch.arange(width, device=self.device),
                past_key_values=cache,
                use_cache=True,
            ).logits
            logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None])
            totals = totals + (logp[..., 0] * valid).sum(-1)
        return totals.tolist()

    # ------------------------------------------------------------------ strings
    def write_strings(self, rows: list[int]) -> None:
        """One string for every given row (its list's next item), then go on or stop."""
        contents = self._generate(rows)
        open_ = [
            i for i, content in zip(rows, contents, strict=True) if self.rows[i].end_string(content)
        ]
        if open_:
            # the first character of each decides, one token each: no length bias
            scores = self.score([(i, [_CONTINUE[0], _CLOSE]) for i in open_])
            for i, (go_on, stop) in zip(open_, scores, strict=True):
                if go_on > stop:
                    self.rows[i].text += _CONTINUE
                else:
                    self.rows[i].end_list()

    def _generate(self, rows: list[int]) -> list[str]:
        """Greedy string contents under the JSON-string masks, with the KV cache."""
        import torch

        prompts = [self.rows[i].context[-1:] + self.encode(self.rows[i].text) for i in rows]
        out, mask, positions = self._extend(rows, prompts)
        content, first, closer = self._masks(out.logits.shape[-1])
        closers = set(closer.nonzero().flatten().tolist())
        limits = [self.rows[i].kind.max_tokens for i in rows]
        tokens: list[list[int]] = [[] for _ in rows]
        writing = [True] * len(rows)
        for step in range(max(limits)):
            allowed = first if step == 0 else content | closer
            picks = out.logits[:, -1].float().masked_fill(~allowed, float("-inf")).argmax(-1)
            for b, t in enumerate(picks.tolist()):
                if writing[b]:
                    if t in closers:
                        writing[b] = False
                    else:
                        tokens[b].append(t)
                        writing[b] = len(tokens[b]) < limits[b]
            if not any(writing):
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = self.model(
                input_ids=picks[:, None],
                attention_mask=mask,
                position_ids=positions[:, None],
                past_key_values=out.past_key_values,
                use_cache=True,
            )
            positions = positions + 1
        return [self.tokenizer.decode(t, clean_up_tokenization_spaces=False) for t in tokens]

    def _masks(self, vocab: int) -> tuple[Any, Any, Any]:
        """(content, first, closer) token masks over the model's ``vocab`` logits."""
        import torch

        return tuple(
            torch.as_tensor(np.pad(m, (0, max(0, vocab - len(m))))[:vocab], device=self.device)
            for m in _vocab_masks(self.tokenizer)
        )

    # ------------------------------------------------------------------ passes
    def _extend(self, rows: list[int], seqs: list[list[int]]) -> tuple[Any, Any, Any]:
        """One pass over ``seqs``, each after a copy of its row's context cache (a row may
        appear more than once), keeping the last position's logits. Returns the output,
        the whole attention mask and each sequence's next position id."""
        import torch

        index = torch.as_tensor(rows, device=self.device)
        ids, mask = self._left_pad(seqs)  # the padding sits between a context and its tokens
        start = self.lengths[index, None]
        whole = torch.cat([self.mask[index], mask], dim=1)
        out = self.model(
            input_ids=ids,
            attention_mask=whole,
            position_ids=start + (mask.cumsum(-1) - 1).clamp(min=0),
            past_key_values=_fork(self.cache, index),
            use_cache=True,
            logits_to_keep=1,
        )
        return out, whole, start[:, 0] + mask.sum(-1)

    def _left_pad(self, seqs: list[list[int]]) -> tuple[Any, Any]:
        import torch

        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for b, seq in enumerate(seqs):
            if seq:
                ids[b, width - len(seq) :] = torch.as_tensor(seq)
                mask[b, width - len(seq) :] = 1
        return ids.to(self.device), mask.to(self.device)


def _fork(cache: Any, index: Any) -> Any:
    """A cache of the rows ``index`` (repeats allowed), leaving ``cache`` as it was.

    The dynamic cache a forward pass makes only ever replaces its layers' tensors
    (``torch.cat``, ``index_select``), never writes into them, so copying the layer
    objects is enough; a cache without ``layers`` (older transformers) is copied whole."""
    if cache is None:
        return None
    if hasattr(cache, "layers"):
        fork = copy.copy(cache)
        fork.layers = [copy.copy(layer) for layer in cache.layers]
    else:
        fork = copy.deepcopy(cache)
    fork.reorder_cache(index)
    return fork


def _vocab_masks(tokenizer: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Boolean masks over the tokenizer's ids, made once per tokenizer (each id decoded
    once): tokens that may sit inside a JSON string, those that may start one (a
    non-space character), and those that close one."""
    key = id(tokenizer)
    if key not in _VOCAB_MASKS:
        texts = tokenizer.batch_decode(
            [[i] for i in range(len(tokenizer))], clean_up_tokenization_spaces=False
        )
        special = sorted(set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder))
        content = np.array([bool(t) and not _UNSAFE.search(t) for t in texts])
        first = content & np.array([not t.isspace() for t in texts])
        closer = np.array([bool(_CLOSER.fullmatch(t)) for t in texts])
        for mask in (content, first, closer):
            mask[special] = False
        if not closer.any():
            raise ValueError(
                f"tokenizer {tokenizer.name_or_path!r} has no token for '\"'; guided decoding "
                "of Strings needs one"
            )
        _VOCAB_MASKS[key] = (tokenizer, (content, first, closer))
    return _VOCAB_MASKS[key][1]


def _pack(units: list[_Unit], cap: int) -> list[list[_Unit]]:
    """Consecutive units in groups of at most ``cap`` candidates (a unit has <= cap)."""
    groups: list[list[_Unit]] = []
    size = cap
    for unit in units:
        if size + len(unit.suffixes) > cap:
            groups.append([])
            size = 0
        groups[-1].append(unit)
        size += len(unit.suffixes)
    return groups


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
