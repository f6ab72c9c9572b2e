"""What a judge's reply may hold: one JSON object with fields in a fixed order.

A signal states the shape of the reply it parses as a :data:`ReplySchema`, per request
(a bound can depend on the request, e.g. the length of the reference plan). The judge
backends use it to constrain decoding (``hf``: guided decoding; ``openai``: a
``json_schema`` response format) so that even a small judge answers in the expected
form; the signal still parses every reply strictly, so an unconstrained backend works too.

Field kinds:

* :class:`Choice`: one of a few JSON numbers (a grade or a score);
* :class:`Count`: an integer in ``[0, max]``, where ``max`` is a number or the value of
  an earlier field (``at_most="model_plan_steps"``);
* :class:`Strings`: a non-empty list of non-empty strings (a plan's steps).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["Choice", "Count", "ReplySchema", "Strings", "json_schema", "render_value"]


@dataclass(frozen=True)
class Choice:
    """One of ``values`` (rendered with ``json.dumps``: ``1`` and ``1.0`` differ)."""

    values: tuple[int | float, ...]

    def __post_init__(self) -> None:
        if not self.values:
            raise ValueError("Choice needs at least one value")


@dataclass(frozen=True)
class Count:
    """An integer in ``[0, max]``; with ``at_most``, in ``[0, value of that earlier field]``."""

    max: int = 20
    at_most: str | None = None

    def __post_init__(self) -> None:
        if self.max < 0:
            raise ValueError(f"Count.max must be >= 0, got {self.max}")


@dataclass(frozen=True)
class Strings:
    """A list of ``min_items..max_items`` strings, each non-empty after stripping and at
    most ``max_tokens`` tokens long under guided decoding."""

    min_items: int = 1
    max_items: int = 8
    max_tokens: int = 32

    def __post_init__(self) -> None:
        if not 1 <= self.min_items <= self.max_items or self.max_tokens < 1:
            raise ValueError(
                f"Strings needs 1 <= min_items <= max_items and max_tokens >= 1, got "
                f"{self.min_items}, {self.max_items}, {self.max_tokens}"
            )


Field = Choice | Count | Strings
ReplySchema = tuple[tuple[str, Field], ...]
"""The reply's fields, in the order they are written."""


def render_value(value: Any) -> str:
    """A field value as it appears in the reply (JSON)."""
    return json.dumps(value)


def count_bound(field: Count, earlier: dict[str, Any]) -> int:
    """The inclusive upper bound of a :class:`Count` given the fields written before it."""
    if field.at_most is None:
        return field.max
    bound = earlier.get(field.at_most)
    if not isinstance(bound, int):
        raise ValueError(f"Count(at_most={field.at_most!r}) needs an earlier integer field")
    return min(bound, field.max)


def json_schema(schema: ReplySchema) -> dict[str, Any]:
    """The JSON Schema of a reply (for an OpenAI-compatible ``response_format``).

    ``at_most`` cannot be said in JSON Schema; such a count gets only its ``max``, and the
    signal's parser still refuses a reply that breaks the bound."""
    properties: dict[str, Any] = {}
    for name, field in schema:
        if isinstance(field, Choice):
            properties[name] = {"enum": list(field.values)}
        elif isinstance(field, Count):
            properties[name] = {"type": "integer", "minimum": 0, "maximum": field.max}
        else:
            properties[name] = {
                "type": "array",
                "items": {"type": "string", "minLength": 1},
                "minItems": field.min_items,
                "maxItems": field.max_items,
            }
    return {
        "type": "object",
        "properties": properties,
        "required": [name for name, _ in schema],
        "additionalProperties": False,
    }
