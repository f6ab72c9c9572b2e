"""Guided decoding: a local judge's reply in exactly the form its signal asks for.

A small (or untrained) model rarely writes valid JSON on its own, and every malformed
reply is a null judgement. Here the reply is built field by field from the signal's
:data:`~ray_credit.signals._reply.ReplySchema`, and the model decides only what the
schema leaves open:

* literal text (braces, quotes, field names, separators) is forced;
* a :class:`~ray_credit.signals._reply.Choice` or :class:`~ray_credit.signals._reply.Count`
  is the allowed value whose tokens have the highest total log-probability after the
  reply so far (teacher-forced; the first value wins a tie); a count ranges over
  ``0..bound``, the bound being its ``max`` or the value of the field it is ``at_most``;
* a :class:`~ray_credit.signals._reply.Strings` list: each string is generated greedily
  from the tokens that cannot break a JSON string (no quote, backslash, newline or other
  control character), its first token holding a non-space character, until the model
  picks the closing quote or ``max_tokens`` is reached; after each string, continuing
  the list or closing it is chosen like a value, within ``min_items..max_items``.

The reply so far is re-encoded whenever it grows, so the model always sees the text's own
tokenization, not the pieces it was assembled from. Decoding is deterministic (argmax
everywhere) and batched: the candidates of every row at the same kind of slot are scored
in shared forward passes (left-padded, ``max_batch_rows`` rows each), and strings are
generated for all rows at once with the model's KV cache.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ray_credit.signals._reply import Choice, Count, ReplySchema, Strings, count_bound, render_value

__all__ = ["guided_replies"]

_VOCAB_MASKS: dict[int, tuple[Any, tuple[np.ndarray, ...]]] = {}  # id -> (tokenizer, masks)


@dataclass
class _Row:
    """One reply under construction."""

    context: list[int]
    schema: ReplySchema
    text: str = "{"
    position: int = 0  # index of the field being written
    values: dict[str, Any] = field(default_factory=dict)
    items: int = 0  # strings written in the current list

    @property
    def done(self) -> bool:
        return self.position == len(self.schema)

    def current(self) -> tuple[str, Any]:
        return self.schema[self.position]

    def open_field(self) -> None:
        """Write the next field's key (and a list's opening)."""
        name, kind = self.current()
        self.text += ("" if self.position == 0 else ", ") + json.dumps(name) + ": "
        if isinstance(kind, Strings):
            self.text += '["'
            self.items = 0

    def close_field(self, value: Any) -> None:
        """Record the field's value (what a later ``at_most`` reads) and move on."""
        name, _ = self.current()
        self.values[name] = value
        self.position += 1
        if self.done:
            self.text += "}"
        else:
            self.open_field()


def guided_replies(
    model: Any,
    tokenizer: Any,
    contexts: Sequence[Sequence[int]],
    schemas: Sequence[ReplySchema],
    *,
    max_batch_rows: int = 64,
) -> list[str]:
    """The reply to each context (its token ids, the chat template applied) in the form of
    its schema: a JSON object with the schema's fields in order (module docstring)."""
    if len(contexts) != len(schemas):
        raise ValueError(f"one schema per context: got {len(contexts)} and {len(schemas)}")
    if max_batch_rows < 1:
        raise ValueError(f"max_batch_rows must be >= 1, got {max_batch_rows}")
    for schema in schemas:
        if not schema:
            raise ValueError("a reply schema needs at least one field")
        for name, kind in schema:
            if not isinstance(kind, (Choice, Count, Strings)):
                raise TypeError(f"field {name!r}: {kind!r} is not a Choice, Count or Strings")
    decoder = _Decoder(model, tokenizer, max_batch_rows)
    rows = [_Row(list(c), tuple(s)) for c, s in zip(contexts, schemas, strict=True)]
    for row in rows:
        row.open_field()
    while True:
        values = [r for r in rows if not r.done and not isinstance(r.current()[1], Strings)]
        strings = [r for r in rows if not r.done and isinstance(r.current()[1], Strings)]
        if not values and not strings:
            return [r.text for r in rows]
        if values:
            decoder.choose_values(values)
        if strings:
            decoder.write_strings(strings)


class _Decoder:
    def __init__(self, model: Any, tokenizer: Any, max_batch_rows: int) -> None:
        self.model, self.tokenizer, self.max_rows = model, tokenizer, max_batch_rows
        self.device = next(model.parameters()).device
        self.pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # ------------------------------------------------------------------ values
    def choose_values(self, rows: list[_Row]) -> None:
        """Every row's current Choice / Count field, by the candidates' log-probabilities."""
        options = []
        for row in rows:
            name, kind = row.current()
            if isinstance(kind, Choice):
                options.append(list(kind.values))
            else:
                options.append(list(range(count_bound(kind, row.values) + 1)))
        asks = [
            (row, [render_value(v) for v in opts]) for row, opts in zip(rows, options, strict=True)
        ]
        scores = self.score(asks)
        for row, opts, score in zip(rows, options, scores, strict=True):
            value = opts[int(np.argmax(score))]
            row.text += render_value(value)
            row.close_field(value)

    def score(self, asks: list[tuple[_Row, list[str]]]) -> list[np.ndarray]:
        """Total log-probability of each candidate continuation of each row's reply."""
        import torch

        seqs: list[tuple[list[int], int]] = []  # (ids, how many trailing ids are the candidate)
        owners: list[tuple[int, int]] = []
        for i, (row, candidates) in enumerate(asks):
            base = self.encode(row.text)
            for j, candidate in enumerate(candidates):
                full = self.encode(row.text + candidate)
                k = _common_prefix(base, full)
                seqs.append((row.context + full, len(full) - k))
                owners.append((i, j))
        out = [np.full(len(c), -np.inf) for _, c in asks]
        order = sorted(range(len(seqs)), key=lambda s: len(seqs[s][0]))
        for start in range(0, len(order), self.max_rows):
            part = order[start : start + self.max_rows]
            width = max(len(seqs[s][0]) for s in part)
            keep = max(seqs[s][1] for s in part) + 1
            ids, mask = self._left_pad([seqs[s][0] for s in part], width)
            with torch.inference_mode():
                logits = self.model(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                    logits_to_keep=keep,
                ).logits.float()
            logp = torch.log_softmax(logits, dim=-1)
            for b, s in enumerate(part):
                n = seqs[s][1]
                targets = ids[b, width - n :]
                positions = torch.arange(keep - 1 - n, keep - 1, device=logp.device)
                i, j = owners[s]
                out[i][j] = float(logp[b, positions, targets].sum())
        return out

    # ------------------------------------------------------------------ strings
    def write_strings(self, rows: list[_Row]) -> None:
        """One string for every row (its list's next item), then continue or close."""
        for start in range(0, len(rows), self.max_rows):
            part = rows[start : start + self.max_rows]
            for row, text in zip(part, self._generate(part), strict=True):
                row.text += text + '"'
                row.items += 1
        undecided = []
        for row in rows:
            _, kind = row.current()
            if row.items < kind.min_items:
                row.text += ', "'
            elif row.items >= kind.max_items:
                row.text += "]"
                row.close_field(None)
            else:
                undecided.append(row)
        if undecided:
            scores = self.score([(row, [', "', "]"]) for row in undecided])
            for row, score in zip(undecided, scores, strict=True):
                if score[0] > score[1]:
                    row.text += ', "'
                else:
                    row.text += "]"
                    row.close_field(None)

    def _generate(self, rows: list[_Row]) -> list[str]:
        """Greedy string contents under the JSON-string mask, ended by a closing quote."""
        import torch
        from transformers import LogitsProcessor, LogitsProcessorList

        content, first, close = self._masks()
        limit = max(row.current()[1].max_tokens for row in rows)
        prompts = [row.context + self.encode(row.text) for row in rows]
        width = max(len(p) for p in prompts)
        ids, mask = self._left_pad(prompts, width)

        class StringMask(LogitsProcessor):
            def __call__(self, input_ids, scores):
                allowed = first if input_ids.shape[1] == width else content | close
                return scores.masked_fill(~allowed[: scores.shape[-1]], float("-inf"))

        with torch.inference_mode():
            output = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=limit,
                do_sample=False,
                logits_processor=LogitsProcessorList([StringMask()]),
                eos_token_id=close.nonzero().flatten().tolist(),
                pad_token_id=self.pad,
            )
        texts = []
        closing = set(close.nonzero().flatten().tolist())
        for row, new in zip(rows, output[:, width:].tolist(), strict=True):
            tokens: list[int] = []
            for t in new[: row.current()[1].max_tokens]:
                if t in closing:
                    break
                tokens.append(t)
            texts.append(self.tokenizer.decode(tokens))
        return texts

    def _masks(self):
        """(content tokens, first-token candidates, closing quote) as boolean vectors over
        the model's vocabulary, cached per tokenizer."""
        import torch

        key = id(self.tokenizer)
        if key not in _VOCAB_MASKS:
            size = len(self.tokenizer)
            texts = self.tokenizer.batch_decode([[i] for i in range(size)])
            special = set(self.tokenizer.all_special_ids) | set(
                getattr(self.tokenizer, "added_tokens_decoder", {})
            )
            content = np.array(
                [i not in special and _safe_in_string(t) for i, t in enumerate(texts)], dtype=bool
            )
            first = content & np.array([bool(t.strip()) for t in texts], dtype=bool)
            close = np.array([t == '"' for t in texts], dtype=bool)
            if not close.any():
                raise ValueError("guided decoding needs a tokenizer with a token for '\"'")
            _VOCAB_MASKS[key] = (self.tokenizer, (content, first, close))  # keeps the id taken
        vocab = self.model.get_output_embeddings().weight.shape[0]
        return tuple(
            torch.as_tensor(np.pad(m, (0, max(0, vocab - len(m))))[:vocab], device=self.device)
            for m in _VOCAB_MASKS[key][1]
        )

    def _left_pad(self, seqs: list[list[int]], width: int):
        import torch

        ids = torch.full((len(seqs), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for b, seq in enumerate(seqs):
            ids[b, width - len(seq) :] = torch.as_tensor(seq)
            mask[b, width - len(seq) :] = 1
        return ids.to(self.device), mask.to(self.device)


def _safe_in_string(text: str) -> bool:
    """A token text that can sit inside a JSON string as it is."""
    return (
        bool(text)
        and "\ufffd" not in text
        and not any(c in '"\\' or ord(c) < 32 or ord(c) == 127 for c in text)
    )


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
