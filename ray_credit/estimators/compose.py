"""Compositions of credit parts: write an estimator in one line, in Python or as text.

The same expression works in both::

    from ray_credit.estimators.compose import P, compose
    est = compose(P.outcome + 0.5 * P.folr + 0.3 * P.info_gain | P.turn_position | P.contribution)
    est = compose("outcome + 0.5*folr + 0.3*info_gain | turn_position | contribution")

Grammar (Python's operator precedence: ``*`` before ``+`` before ``|``)::

    estimator  := advantage ("|" weighting)*
    advantage  := rewards "|" normalizer ("|" transform)*
                | ["-" | "+"] [number "*"] "(" advantage ")"
                  (("+" | "-") [number "*"] "(" advantage ")")* ("|" transform)*
    rewards    := ["-" | "+"] [number "*"] reward (("+" | "-") [number "*"] reward)*
    part       := name | name "(" setting "=" value, ... ")"
    value      := number | "quoted string" | word (inf, true, false, or a choice: none)

docs/algorithms.md, section 10, writes out the math of each part and of the sums.

Rewards add up before they are normalized; normalized terms add up after (A²TGPO:
``0.3*(info_gain | turn_position(padding="none") | rescaled_sum) + (outcome | group)``).
Text is parsed with :mod:`ast` into this grammar only (names, numbers, strings and the
operators above): nothing in it runs as code.

:func:`compose` checks the composition before anything runs and refuses one that cannot
work, with the reason: a per-turn reward under a normalizer that takes one value per
trajectory, padding with a final reward the rewards do not have, a weighting that reads a
term the composition lacks, two parts asking for different settings of one signal or one
learner setting. The result is an :class:`~ray_credit.estimators.Estimator` whose
``signals`` and ``learner`` are its parts', so a pipeline runs their signals as stages and
trains with their settings.
"""

from __future__ import annotations

import ast
import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ray_credit.batch import TrajectoryBatch
from ray_credit.estimators._base import Estimator
from ray_credit.estimators.parts import (
    PARTS,
    Advantage,
    Part,
    Rewards,
    Term,
    get_part,
)

__all__ = ["P", "CompositionError", "compose", "is_composition", "parse"]


class CompositionError(ValueError):
    """A composition that cannot be built or cannot work (the message says why)."""


# --------------------------------------------------------------------------- the algebra


class _Node:
    """Operators shared by every piece of a composition."""

    def __add__(self, other: Any) -> Any:
        return _add(self, _coerce(other), 1.0)

    def __sub__(self, other: Any) -> Any:
        return _add(self, _coerce(other), -1.0)

    def __mul__(self, coef: Any) -> Any:
        return _scale(self, coef)

    __rmul__ = __mul__

    def __neg__(self) -> Any:
        return _scale(self, -1.0)

    def __pos__(self) -> Any:
        return self

    def __or__(self, stage: Any) -> Any:
        return _pipe(self, _coerce(stage))


@dataclass(frozen=True, eq=True)
class Use(_Node):
    """A part with its settings (``folr(alpha=0.5)``); call it to change them."""

    part: str
    settings: tuple[tuple[str, Any], ...] = ()

    @property
    def kind(self) -> str:
        return get_part(self.part).kind

    def __call__(self, **settings: Any) -> Use:
        part = get_part(self.part)
        merged = {**dict(self.settings), **{k: _plain(part, k, v) for k, v in settings.items()}}
        part.config(**merged)  # refuses an unknown or bad setting now
        defaults = part.config()  # kept: the settings that differ from the defaults
        changed = {k: v for k, v in merged.items() if getattr(defaults, k) != v}
        return Use(self.part, tuple(sorted(changed.items())))

    def config(self) -> Any:
        return get_part(self.part).config(**dict(self.settings))

    def __str__(self) -> str:
        if not self.settings:
            return self.part
        return f"{self.part}({', '.join(f'{k}={_value_text(v)}' for k, v in self.settings)})"


@dataclass(frozen=True)
class RewardSum(_Node):
    """Weighted reward terms, added before normalization."""

    terms: tuple[tuple[float, Use], ...]

    def __str__(self) -> str:
        return _sum_text(self.terms, lambda u: str(u))


@dataclass(frozen=True)
class Normalized(_Node):
    """Rewards through a normalizer, then transforms."""

    rewards: RewardSum
    normalizer: Use
    transforms: tuple[Use, ...] = ()

    def __str__(self) -> str:
        return " | ".join([str(self.rewards), str(self.normalizer), *map(str, self.transforms)])


@dataclass(frozen=True)
class AdvantageSum(_Node):
    """Weighted normalized terms, added, then transforms."""

    terms: tuple[tuple[float, Any], ...]
    transforms: tuple[Use, ...] = ()

    def __str__(self) -> str:
        body = _sum_text(self.terms, lambda t: f"({t})")
        return " | ".join([body, *map(str, self.transforms)])


@dataclass(frozen=True)
class Composition(_Node):
    """An advantage and the weightings applied to it: what :func:`compose` builds."""

    advantage: Any  # Normalized | AdvantageSum
    weightings: tuple[Use, ...] = ()

    def __str__(self) -> str:
        return " | ".join([str(self.advantage), *map(str, self.weightings)])


def _plain(part: Part, name: str, value: Any) -> Any:
    """A setting's value as the text writes it: a numpy scalar as its Python number, an
    integer given to a float setting as a float (so both spellings name one estimator)."""
    if isinstance(value, np.generic):
        value = value.item()
    fields = {f.name: f.type for f in dataclasses.fields(part.config_cls)}
    integer = isinstance(value, int) and not isinstance(value, bool)
    if integer and fields.get(name) in ("float", float):
        return float(value)
    return value


def _value_text(value: Any) -> str:
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return repr(value)


def _number_text(coef: float) -> str:
    return repr(float(coef)).removesuffix(".0") if float(coef).is_integer() else repr(coef)


def _sum_text(terms, show) -> str:
    out = []
    for i, (coef, item) in enumerate(terms):
        size = abs(coef)
        body = show(item) if size == 1 else f"{_number_text(size)}*{show(item)}"
        if i == 0:
            out.append(("-" if coef < 0 else "") + body)
        else:
            out.append(f"{'-' if coef < 0 else '+'} {body}")
    return " ".join(out)


def _coerce(x: Any) -> Any:
    if isinstance(x, _Node):
        return x
    if isinstance(x, str):
        return parse(x)
    raise CompositionError(f"a composition is made of parts, got {x!r} ({type(x).__name__})")


def _level(x: Any) -> str:
    """'rewards', 'advantage' or 'composition' (what a piece of the expression is)."""
    if isinstance(x, Use):
        kind = x.kind
        if kind == "reward":
            return "rewards"
        raise CompositionError(
            f"{x.part} is a {kind}: it goes after a '|' ({_placement(kind)}), not in a sum"
        )
    if isinstance(x, RewardSum):
        return "rewards"
    if isinstance(x, (Normalized, AdvantageSum)):
        return "advantage"
    if isinstance(x, Composition):
        return "composition"
    raise CompositionError(f"a composition is made of parts, got {x!r} ({type(x).__name__})")


def _placement(kind: str) -> str:
    return {
        "normalizer": "rewards | normalizer, e.g. outcome | group",
        "transform": "after a normalizer, e.g. info_gain + outcome(at='last') | group_turns | "
        "discount",
        "weighting": "at the end, e.g. outcome | group | contribution",
    }[kind]


def _as_sum(x: Any) -> Any:
    """``x`` as a sum whose terms can take weights: a transformed sum becomes one term."""
    if isinstance(x, Use):
        return RewardSum(((1.0, x),))
    if isinstance(x, Normalized) or (isinstance(x, AdvantageSum) and x.transforms):
        return AdvantageSum(((1.0, x),))
    return x


_MAX_WEIGHT = float(np.finfo(np.float32).max)
"""The largest weight in size: advantages are float32, and a larger weight on rewards
overflows the normalizer's variance into NaN advantages."""


def _too_large(coef: float) -> str:
    return (
        f"a weight in a composition is at most {_MAX_WEIGHT:.3g} in size (the advantages "
        f"are float32; a larger one overflows to inf or NaN), got {coef!r}"
    )


def _number(coef: Any) -> float:
    if isinstance(coef, np.generic):  # a numpy scalar weighs as its Python number
        coef = coef.item()
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not math.isfinite(coef):
        raise CompositionError(f"a weight in a composition is a finite number, got {coef!r}")
    if abs(coef) > _MAX_WEIGHT:
        raise CompositionError(_too_large(coef))
    return float(coef)


def _scale(x: Any, coef: Any) -> Any:
    c = _number(coef)
    level = _level(x)
    if level == "composition":
        raise CompositionError(
            f"weights go on rewards or normalized terms, not after the weightings: {x}"
        )
    s = _as_sum(x)
    return type(s)(tuple((_number(c * w), t) for w, t in s.terms))  # 1e38*(1e38*outcome)


def _add(a: Any, b: Any, sign: float) -> Any:
    la, lb = _level(a), _level(b)
    if "composition" in (la, lb):
        raise CompositionError(
            "weightings come last: add the terms first, then '| weighting' "
            f"(got a sum with {a if la == 'composition' else b})"
        )
    if la != lb:
        raise CompositionError(
            "a sum adds rewards to rewards (before a normalizer) or normalized terms to "
            f"normalized terms (each in parentheses), not rewards to advantages: {a} + {b}; "
            "normalize the rewards first, e.g. (outcome | group) + 0.3*(info_gain | "
            "turn_position(padding='none'))"
        )
    sa, sb = _as_sum(a), _as_sum(b)
    return type(sa)((*sa.terms, *((sign * w, t) for w, t in sb.terms)))


def _pipe(x: Any, stage: Any) -> Any:
    level = _level(x)  # refuses a normalizer, transform or weighting before the '|'
    if not isinstance(stage, Use) or stage.kind == "reward":
        what = stage.part if isinstance(stage, Use) else str(stage)
        raise CompositionError(
            f"after '|' comes a normalizer, a transform or a weighting, got {what}; rewards "
            "add up with '+' before the normalizer"
        )
    kind = stage.kind
    if kind == "normalizer":
        if level != "rewards":
            raise CompositionError(
                f"{stage.part} normalizes rewards, and {x} is normalized already: one "
                "normalizer per term"
            )
        return Normalized(_as_sum(x), stage)
    if kind == "transform":
        if level == "rewards":
            raise CompositionError(
                f"{stage.part} transforms normalized values: put a normalizer before it "
                f"({x} | group_turns | {stage.part})"
            )
        if level == "composition":
            raise CompositionError(f"{stage.part} is a transform: it goes before the weightings")
        if any(t.part == stage.part for t in x.transforms):
            raise CompositionError(
                f"{stage.part} appears twice among the transforms of {x}: the second applies "
                "it again to what the first gave; give it once"
            )
        return dataclasses.replace(x, transforms=(*x.transforms, stage))
    # a weighting
    if level == "rewards":
        raise CompositionError(
            f"{stage.part} weighs advantages: normalize the rewards first ({x} | group | "
            f"{stage.part})"
        )
    if level == "composition":
        return dataclasses.replace(x, weightings=(*x.weightings, stage))
    return Composition(x, (stage,))


class _Parts:
    """``P.folr``, ``P.turn_position(padding="none")``: every registered part, to compose in
    Python."""

    def __getattr__(self, name: str) -> Use:
        if name.startswith("_"):
            raise AttributeError(name)
        get_part(name)
        return Use(name)

    def __dir__(self) -> list[str]:
        return sorted(PARTS)


P = _Parts()


# --------------------------------------------------------------------------- text


_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.BitOr: "|"}
_ASCII = {"\u2212": "-", "\u2013": "-", "\u2014": "-", "\u00d7": "*", "\u00b7": "*",
          "\u2217": "*", "\uff5c": "|", "\u2223": "|", "\uff0b": "+", "\u00a0": " ",
          "\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u200b": "",
          "\ufeff": ""}  # fmt: skip
"""Characters pasted from papers and word processors, and the ASCII the parser reads."""
_WORDS = {"inf": math.inf, "true": True, "false": False, "True": True, "False": False}


def parse(text: str) -> Any:
    """The composition that ``text`` writes (the grammar in the module docstring)."""
    if not isinstance(text, str) or not text.strip():
        raise CompositionError(f"a composition is a non-empty string, got {text!r}")
    try:
        built = _build(_tree(text.strip()), text)
    except SyntaxError as err:
        shown = text if len(text) <= 120 else f"{text[:120]}..."
        at = (
            f"line {err.lineno}, column {err.offset}" if err.lineno != 1 else f"column {err.offset}"
        )
        if not err.offset:  # Python gives column 0 where the text ends too early
            last = text.strip()[-1:]
            at = f"its end (after {last!r})" if last in "+-*|(" else "its end"
        pasted = [c for c in dict.fromkeys(text) if c in _ASCII]
        fix = ", ".join(
            f"write {c!r} (U+{ord(c):04X}) as {_ASCII[c]!r}" if _ASCII[c] else
            f"remove {c!r} (U+{ord(c):04X})" for c in pasted
        ) or 'write e.g. "outcome + 0.5*folr | turn_position | contribution"'  # fmt: skip
        raise CompositionError(
            f"cannot read the composition {shown!r}: {err.msg} at {at}; {fix}"
        ) from None
    except (RecursionError, MemoryError):
        raise CompositionError(
            f"the composition of {len(text)} characters is too deeply nested to read"
        ) from None
    if _is_number(built):
        raise CompositionError(f"{text!r} is a number, not a composition of parts")
    return built


def _tree(source: str) -> ast.AST:
    """The expression ``source`` writes; one written over lines (a YAML block scalar) is
    read as if in parentheses. A syntax error is the one in the text as written."""
    try:
        return ast.parse(source, mode="eval").body
    except SyntaxError:
        if "\n" not in source:
            raise
        try:
            return ast.parse(f"({source}\n)", mode="eval").body
        except SyntaxError:
            pass
        raise


def _build(node: ast.AST, text: str) -> Any:
    if isinstance(node, ast.Name):
        if node.id.lower() in ("nan", "inf", "infinity") and node.id not in PARTS:
            raise CompositionError(
                f"in {text!r}: {node.id} is not a part, and a weight is a finite number"
            )
        return _use(node.id, {}, text)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        _part(node.func.id, text)  # float('nan') names no part: say so first
        if node.args:
            raise CompositionError(
                f"in {text!r}: a part's settings are given by name, e.g. folr(alpha=0.5)"
            )
        settings = {kw.arg: _setting(kw.value, text) for kw in node.keywords}
        if None in settings:
            raise CompositionError(f"in {text!r}: settings are name=value")
        if len(settings) != len(node.keywords):
            raise CompositionError(f"in {text!r}: {node.func.id} is given a setting twice")
        return _use(node.func.id, settings, text)
    if isinstance(node, ast.Constant) and _is_number(node.value):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd):
        return _build(node.operand, text)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _build(node.operand, text)
        return -inner if _is_number(inner) else _scale(inner, -1.0)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _build(node.left, text), _build(node.right, text)
        op = _OPS[type(node.op)]
        if op == "*":
            if _is_number(left) and _is_number(right):  # 2*0.5*folr
                return left * right
            number, other = (left, right) if _is_number(left) else (right, left)
            if not _is_number(number) or _is_number(other):
                raise CompositionError(f"in {text!r}: '*' multiplies a part by one number")
            if not math.isfinite(number):
                raise CompositionError(f"in {text!r}: a weight is a finite number, got {number!r}")
            if abs(number) > _MAX_WEIGHT:
                raise CompositionError(f"in {text!r}: {_too_large(number)}")
            return _scale(other, number)
        if _is_number(left) or _is_number(right):
            raise CompositionError(
                f"in {text!r}: a number stands only as a weight (0.5*folr), not on its own"
            )
        if op == "|":
            return _pipe(left, right)
        return _add(left, right, 1.0 if op == "+" else -1.0)
    raise CompositionError(
        f"in {text!r}: {ast.unparse(node)!r} is not part of a composition (names of parts, "
        "numbers, + - * | and parentheses)"
    )


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _setting(node: ast.AST, text: str) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str, bool)):
        return node.value
    if isinstance(node, ast.Name):  # a bare word: inf, true/false, or a choice
        return _WORDS.get(node.id, node.id)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _setting(node.operand, text)
        if _is_number(value):
            return -value if isinstance(node.op, ast.USub) else value
    raise CompositionError(
        f"in {text!r}: a setting's value is a number, a word or a quoted string, got "
        f"{ast.unparse(node)!r}"
    )


def _part(name: str, text: str) -> None:
    try:
        get_part(name)
    except ValueError as err:
        raise CompositionError(f"in {text!r}: {err}") from None


def _use(name: str, settings: dict[str, Any], text: str) -> Use:
    _part(name, text)
    try:
        return Use(name)(**settings)
    except (TypeError, ValueError) as err:
        raise CompositionError(f"in {text!r}: {err}") from None


def is_composition(text: str) -> bool:
    """Whether ``text`` is a composition rather than an estimator's name."""
    return any(c in text for c in "|+-(*") or text.strip() in PARTS


# --------------------------------------------------------------------------- checks


def _leaves(adv: Any) -> list[Normalized]:
    if isinstance(adv, Normalized):
        return [adv]
    return [leaf for _, term in adv.terms for leaf in _leaves(term)]


def _uses(comp: Composition) -> list[Use]:
    out: list[Use] = []

    def walk(adv: Any) -> None:
        if isinstance(adv, Normalized):
            out.extend(u for _, u in adv.rewards.terms)
            out.append(adv.normalizer)
        else:
            for _, term in adv.terms:
                walk(term)
        out.extend(adv.transforms)

    walk(comp.advantage)
    out.extend(comp.weightings)
    return out


def _zero_rewards(use: Use) -> bool:
    part = get_part(use.part)
    return part.zero is not None and part.zero(use.config())


def _cancels(terms: Any) -> bool:
    """Whether weighted terms add up to 0 whatever their values: each term's weights,
    summed over its copies (``outcome - outcome``), are 0."""
    total: dict[Any, float] = {}
    size: dict[Any, float] = {}
    for coef, term in terms:
        total[term] = total.get(term, 0.0) + coef
        size[term] = size.get(term, 0.0) + abs(coef)
    return all(abs(total[t]) <= 1e-9 * size[t] for t in total)  # 0.1 + 0.2 - 0.3 is 0


def _zero(adv: Any) -> bool:
    """Whether ``adv`` is 0 on every turn of every batch. A normalizer gives 0 for rewards
    that are all 0, and transforms and weightings keep 0 at 0, so it is when the weights
    of its terms are 0 or cancel, leaving out terms that are 0 themselves."""
    if isinstance(adv, Normalized):
        return _cancels((c, u) for c, u in adv.rewards.terms if not _zero_rewards(u))
    return _cancels((c, t) for c, t in adv.terms if not _zero(t))


def _weights(adv: Any, scale: float = 1.0) -> list[tuple[Use, float]]:
    """Each reward term's weight in the advantage, once per normalized term it is in: its
    weights in the sum, times those of the sums around it."""
    if isinstance(adv, Normalized):
        net: dict[Use, float] = {}
        for coef, use in adv.rewards.terms:
            net[use] = net.get(use, 0.0) + coef
        return [(use, scale * w) for use, w in net.items()]
    return [pair for coef, term in adv.terms for pair in _weights(term, scale * coef)]


def _check_signs(comp: Composition) -> None:
    """Refuse a penalty that is rewarded, and rewards that are all penalized: either way
    the policy is trained towards what its rewards call worse."""
    weights = [(u, w) for u, w in _weights(comp.advantage) if abs(w) > 1e-12]
    rewards = [(u, w) for u, w in weights if not get_part(u.part).penalty]
    if rewards and all(w < 0 for _, w in rewards):
        names = ", ".join(dict.fromkeys(str(u) for u, _ in rewards))
        raise CompositionError(
            f"{comp}: every reward in it ({names}) has a negative weight, so the policy is "
            "trained away from its rewards, towards wrong answers; give them positive weights "
            "(outcome | group, not -outcome | group). A reward where larger is worse is a "
            "penalty: register its part with penalty=True, as invalid"
        )
    for use, w in weights:
        if get_part(use.part).penalty and w > 0:
            raise CompositionError(
                f"{comp}: {use} is a penalty (larger where the policy did worse), and its "
                f"weight is {_number_text(w)}, which rewards what it penalizes; give it a "
                f"negative weight, e.g. outcome - 0.1*{use} | group_turns"
            )


def _check(comp: Composition) -> None:
    """Refuse what cannot work (the module docstring), naming the part and the fix."""
    if _zero(comp.advantage):
        by_settings = sorted(
            {str(u) for u in _uses(comp) if u.kind == "reward" and _zero_rewards(u)}
        )
        zeros = (
            f"; {', '.join(by_settings)} gives 0 on every turn with those settings"
            if by_settings
            else ""
        )
        raise CompositionError(
            f"{comp}: every advantage would be 0 whatever the batch, so nothing is learned: the "
            f"weights of its terms are 0 or cancel out{zeros}; give a term a weight other than "
            "0, e.g. outcome | group"
        )
    _check_signs(comp)
    for leaf in _leaves(comp.advantage):
        norm, ncfg = leaf.normalizer.part, leaf.normalizer.config()
        rewards = [(u, get_part(u.part), u.config()) for _, u in leaf.rewards.terms]
        per_turn = [str(u) for u, p, c in rewards if p.per_turn is None or p.per_turn(c)]
        final = any(p.final_turn is None or p.final_turn(c) for _, p, c in rewards)
        if norm in ("group", "leave_one_out") and per_turn:
            raise CompositionError(
                f"{norm} compares one value per trajectory, and {', '.join(per_turn)} gives "
                f"each turn its own reward: use turn_position (the same turn of the group's "
                f"other trajectories) or group_turns (all the group's turns)"
            )
        if norm == "turn_position" and ncfg.padding == "final_reward" and not final:
            raise CompositionError(
                f"turn_position pads a short trajectory with its final reward, and "
                f"{leaf.rewards} gives none on the final turn: use "
                "turn_position(padding='none'), or add a reward that has one (outcome)"
            )
        if norm == "anchor_state" and not any(
            p.every_turn is None or p.every_turn(c) for _, p, c in rewards
        ):
            raise CompositionError(
                f"anchor_state compares every turn's reward, and {leaf.rewards} leaves turns "
                "without one: add a reward on every turn (discounted_outcome)"
            )
    seen: dict[str, int] = {}
    for w in comp.weightings:
        seen[w.part] = seen.get(w.part, 0) + 1
        if seen[w.part] > 1:
            raise CompositionError(f"{w.part} appears twice among the weightings")
        cfg = w.config()
        of = getattr(cfg, "of", None)
        if of is not None:
            holders = [leaf for leaf in _leaves(comp.advantage)
                       if any(u.part == of for _, u in leaf.rewards.terms)]  # fmt: skip
            if len(holders) != 1:
                raise CompositionError(
                    f"{w} reads the normalized {of} term, and the composition has "
                    f"{len(holders)}: {'add one' if not holders else 'keep one'} "
                    f"(e.g. ... + 0.3*({of} | turn_position(padding='none')))"
                )
    if "segments" in seen and "adaptive_clip" in seen:
        names = [w.part for w in comp.weightings]
        if names.index("segments") < names.index("adaptive_clip"):
            raise CompositionError(
                "segments carries the clip scale too: put it after adaptive_clip"
            )


def _merged(comp: Composition) -> tuple[tuple[str, ...], dict, dict]:
    """The columns the parts read, their signals and learner settings (conflicts refused)."""
    requires: list[str] = ["group_id", "outcome_reward", "turns"]
    signals: dict[str, dict[str, Any]] = {}
    learner: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for use in _uses(comp):
        part, cfg = get_part(use.part), use.config()
        requires += [c for c in part.requires if c not in requires]
        for name, settings in part.signals_of(cfg).items():
            have = signals.setdefault(name, {})
            for key, value in settings.items():
                if key in have and have[key] != value:
                    raise CompositionError(
                        f"{use} wants the {name} signal with {key}={value!r}, and "
                        f"{owner[f'{name}.{key}']} with {key}={have[key]!r}: one run computes "
                        "it one way; give both the same setting"
                    )
                have[key] = value
                owner[f"{name}.{key}"] = str(use)
        for key, value in part.learner.items():
            if key in learner and learner[key] != value:
                raise CompositionError(
                    f"{use} trains with learner.{key}={value!r}, and {owner[key]} with "
                    f"{learner[key]!r}"
                )
            learner[key] = value
            owner[key] = str(use)
    return tuple(requires), signals, learner


# --------------------------------------------------------------------------- running


def _rewards(batch: TrajectoryBatch, rsum: RewardSum, metrics: dict) -> Rewards:
    parts = []
    for coef, use in rsum.terms:
        r = get_part(use.part).fn(batch, use.config())
        metrics.update({f"{use.part}/{k}": v for k, v in r.metrics.items()})
        parts.append((coef, r))
    if len(parts) == 1 and parts[0][0] == 1.0:
        return parts[0][1]
    values = np.zeros(batch.num_turns)
    defined = None
    any_partial = any(r.defined is not None for _, r in parts)
    if any_partial:
        defined = np.zeros(batch.num_turns, dtype=bool)
    per_traj = np.zeros(len(batch)) if all(r.per_traj is not None for _, r in parts) else None
    turn_groups = np.zeros(batch.num_groups, dtype=bool)
    for coef, r in parts:
        values += coef * r.values
        if defined is not None:
            defined |= True if r.defined is None else r.defined
        if per_traj is not None:
            per_traj += coef * r.per_traj
        turn_groups |= r.turn_groups
    if defined is not None and defined.all():
        defined = None
    return Rewards(values, defined, per_traj, turn_groups)


def _advantage(batch: TrajectoryBatch, adv: Any, metrics: dict) -> Advantage:
    if isinstance(adv, Normalized):
        rewards = _rewards(batch, adv.rewards, metrics)
        values, counts = get_part(adv.normalizer.part).fn(batch, rewards, adv.normalizer.config())
        metrics.update({f"{adv.normalizer.part}/{k}": v for k, v in counts.items()})
        names = tuple(u.part for _, u in adv.rewards.terms)
        terms = [Term(names, values, rewards.defined)]
        out = Advantage(values, rewards.defined, terms, rewards=rewards)
    else:
        outs = [(coef, _advantage(batch, term, metrics)) for coef, term in adv.terms]
        values = np.zeros(batch.num_turns)
        defined = np.zeros(batch.num_turns, dtype=bool)
        for coef, a in outs:
            values += a.values * coef if coef != 1.0 else a.values
            defined |= True if a.defined is None else a.defined
        terms = [t for _, a in outs for t in a.terms]
        out = Advantage(values, None if defined.all() else defined, terms)
    for use in adv.transforms:
        out = get_part(use.part).fn(batch, out, use.config())
    return out


def _run(comp: Composition, batch: TrajectoryBatch) -> TrajectoryBatch:
    metrics: dict[str, float] = {}
    adv = _advantage(batch, comp.advantage, metrics)
    for use in comp.weightings:
        adv = get_part(use.part).fn(batch, adv, use.config())
        metrics.update({f"{use.part}/{k}": v for k, v in adv.metrics.items()})
        adv.metrics = {}
    columns = {"turn_advantages": adv.values.astype(np.float32)}
    if adv.rewards is not None:
        columns["turn_rewards"] = adv.rewards.values.astype(np.float32)
    if adv.clip_scale is not None:
        columns["turn_clip_scale"] = adv.clip_scale
    return batch.with_turn_columns(columns, metrics=metrics)


@dataclass(frozen=True)
class CompositionSettings:
    """A composition's settings are in its text; it has no section of its own."""


def compose(
    spec: Any,
    *,
    name: str | None = None,
    description: str = "",
    learner: Mapping[str, Any] | None = None,
) -> Estimator:
    """The :class:`Estimator` that ``spec`` (text, or parts put together with ``P``) writes.

    Its ``signals`` and ``learner`` settings are its parts' (``learner`` adds or overrides
    settings of the recipe, e.g. a KL coefficient); a composition that cannot work raises
    :class:`CompositionError` saying why. ``name`` defaults to the composition's text.
    """
    if not isinstance(spec, (str, _Node)):
        shown = repr(spec) if len(repr(spec)) <= 80 else f"{repr(spec)[:77]}..."
        raise CompositionError(
            f"compose takes a composition's text or parts put together with P, got {shown} "
            f'({type(spec).__name__}); e.g. compose("outcome | group") or '
            "compose(P.outcome | P.group)"
        )
    if learner is not None and not isinstance(learner, Mapping):
        raise CompositionError(
            f"learner maps learner settings to their values, e.g. {{'kl_coef': 1e-3}}, got "
            f"{learner!r} ({type(learner).__name__})"
        )
    comp = parse(spec) if isinstance(spec, str) else spec
    if isinstance(comp, Use) and comp.kind != "reward":
        raise CompositionError(
            f"{comp} is a {comp.kind}, and a composition begins with rewards: "
            f"{_placement(comp.kind)}"
        )
    if isinstance(comp, (Normalized, AdvantageSum)):
        comp = Composition(comp)
    if not isinstance(comp, Composition):
        raise CompositionError(
            f"{comp} has no normalizer: rewards become advantages through one, e.g. "
            f"{comp} | group (one value per trajectory) or {comp} | turn_position"
        )
    _check(comp)
    requires, signals, parts_learner = _merged(comp)
    text = str(comp)

    def fn(batch: TrajectoryBatch, config: Any) -> TrajectoryBatch:
        return _run(comp, batch)

    fn.__name__ = "composition"
    est = Estimator(
        name or text,
        fn,
        CompositionSettings,
        requires,
        description or f"composition: {text}",
        signals=signals,
        learner={**parts_learner, **(learner or {})},
        group_local=True,  # every part's statistics are within a prompt group
        composition=lambda config: text,
    )
    return est
