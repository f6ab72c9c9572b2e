"""Typed configs from dataclasses: ``--help`` from field docstrings, overrides from a YAML
file and from the command line.

A pipeline's config is a tree of frozen dataclasses. :func:`parse_config` builds an
argparse parser with one ``--section.field`` option per leaf (help text = the field's
docstring without its reST markup, default shown; the choices of a ``Literal`` field and
the length of a fixed tuple in its metavar), one ``--help`` group per section (titled by
the section's class docstring), reads ``--config FILE.yaml`` (a nested mapping of the same
shape; ``default_config`` when no ``--config`` is given) and applies, in order: the
dataclass defaults (or ``defaults``), the YAML file, the command line. ``--help`` shows
the defaults after the YAML file. An unknown key in the file or a value of the wrong type
is an error that names it. A config class may define ``check()`` for rules across its
fields or sections; every section's runs once, at the end (fields are set one at a time,
so ``__post_init__`` can only check one field).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import re
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "InputError",
    "InputFileNotFoundError",
    "check_config",
    "check_fields",
    "config_to_dict",
    "field_docs",
    "leaf_names",
    "parse_config",
    "read_yaml_file",
    "replace_path",
    "unknown_setting",
    "yaml_error",
]


class InputError(ValueError):
    """Something a user handed us is wrong (a file, a folder, a setting); the message names
    it and what to do. Pipeline scripts print it as one line, without a traceback."""


class InputFileNotFoundError(InputError, FileNotFoundError):
    """A file or folder a user named does not exist (or is not the kind named)."""


def field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of a dataclass (its documentation)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(inspect.getsource(klass).lstrip())
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body else []
        for node, nxt in zip(body, body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def config_to_dict(config: Any) -> dict[str, Any]:
    """A config tree as plain nested dicts (for JSON summaries and loggers)."""
    return dataclasses.asdict(config)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_fields(config: Any) -> None:
    """Refuse a field whose value is not of its annotated type, in a config dataclass built
    directly (YAML and flags are converted and checked on the way in): an int field takes
    an int (not a bool, not 2.5), a float field a number that is not NaN, a bool field a
    bool (not ``'no'``, which is truthy), a str field a str, a fixed tuple its length, a
    section its class. Raises TypeError naming the class, the field and what it takes
    (ValueError for a value outside a ``Literal``'s choices).
    Config classes call it first in ``__post_init__``; fields of other types are not
    checked."""
    try:
        hints = _hints(type(config))
    except (NameError, TypeError):  # annotations naming what only a function's scope knows
        return
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        wanted = _type_mismatch(value, hints[f.name])
        if wanted is None:
            continue
        name = f"{type(config).__name__}.{f.name}"
        if _choices(hints[f.name]):  # a choice outside a Literal's is a bad value, not a type
            raise ValueError(f"{name} must be {wanted}, got {value!r}")
        raise TypeError(f"{name} takes {wanted}, got {value!r} ({type(value).__name__})")


def _choices(kind: Any) -> tuple | None:
    """The values a ``Literal[...]`` (or ``Literal[...] | None``) field takes, else None."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        kinds = [a for a in typing.get_args(kind) if a is not type(None)]
        kind = kinds[0] if len(kinds) == 1 else None
    return typing.get_args(kind) if typing.get_origin(kind) is typing.Literal else None


def _type_mismatch(value: Any, kind: Any) -> str | None:
    """What ``kind`` takes, in words, when ``value`` is not one of it; else None."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        wanted = [_type_mismatch(value, a) for a in args if a is not type(None)]
        if any(w is None for w in wanted):
            return None
        return " or ".join([*(w for w in wanted if w), *(["None"] if type(None) in args else [])])
    if origin is typing.Literal:
        return None if value in args else f"one of {list(args)}"
    if kind is bool:
        return None if isinstance(value, bool) else "true or false (a bool)"
    if kind is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return "a number"
        return "a number, not NaN" if value != value else None
    if kind is str:
        return None if isinstance(value, str) else "a string"
    if origin in (tuple, list) and args:
        if not isinstance(value, (tuple, list)):
            return f"a {origin.__name__} of values"
        fixed = origin is tuple and args[-1] is not Ellipsis
        if fixed and len(value) != len(args):
            return f"{len(args)} values"
        inner = args if fixed else (args[0],) * len(value)
        pairs = zip(value, inner, strict=True)
        bad = next((w for v, a in pairs if (w := _type_mismatch(v, a))), None)
        return None if bad is None else f"values that are each {bad}"
    if dataclasses.is_dataclass(kind) and isinstance(kind, type):
        return None if isinstance(value, kind) else f"a {kind.__name__}"
    return None


def _leaves(cls: type, prefix: str = ""):
    """(dotted name, type, default, doc) of every leaf field of a dataclass tree."""
    hints, docs = _hints(cls), field_docs(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(kind):
            yield from _leaves(kind, name + ".")
        else:
            yield name, kind, field_default(f), docs.get(f.name, "")


def field_default(f: dataclasses.Field) -> Any:
    """A dataclass field's default value (its factory's product; None when it has none)."""
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None if f.default is dataclasses.MISSING else f.default


def _convert(value: Any, kind: Any, name: str) -> Any:
    """Check / convert one value (from YAML or the command line) to a field's type."""
    origin = typing.get_origin(kind)
    args = typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        is_none = value is None or (isinstance(value, str) and value.lower() in ("none", "null"))
        if is_none and type(None) in args:
            return None
        choices = _choices(kind)
        if choices is not None and value not in choices:  # Literal[...] | None
            raise ValueError(f"{name} must be one of {list(choices)} or none, got {value!r}")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, name)
            except (TypeError, ValueError) as err:
                errors.append(str(err))
        if len(errors) == 1:  # Optional[X]: X's own message
            raise ValueError(errors[0] + (" (or none)" if type(None) in args else ""))
        raise ValueError(f"{name}: {value!r} is not a {kind} ({'; '.join(errors)})")
    if origin is typing.Literal:
        if value not in args:
            raise ValueError(f"{name} must be one of {list(args)}, got {value!r}")
        return value
    if origin in (tuple, list):
        items = value
        if isinstance(value, str):
            items = [v for v in value.replace(",", " ").split() if v]
        if not isinstance(items, (list, tuple)):
            raise ValueError(f"{name} takes a list, got {value!r}")
        fixed = origin is tuple and args and args[-1] is not Ellipsis
        if fixed and len(items) != len(args):
            raise ValueError(f"{name} takes {len(args)} values ({_metavar(kind)}), got {value!r}")
        inner = args if fixed else (args[0] if args else str,) * len(items)
        out = [_convert(v, a, name) for v, a in zip(items, inner, strict=True)]
        return tuple(out) if origin is tuple else out
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"{name} takes true or false, got {value!r}")
    if kind is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(f"{name} takes an integer, got {value!r}")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name} takes an integer, got {value!r}") from None
    if kind is float:
        if isinstance(value, bool):
            raise ValueError(f"{name} takes a number, got {value!r}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name} takes a number, got {value!r}") from None
        if number != number:
            raise ValueError(f"{name} takes a number, got {value!r} (NaN)")
        return number
    if kind is str:
        if not isinstance(value, (str, int, float)):
            raise ValueError(f"{name} takes a string, got {value!r}")
        return str(value)
    if kind is Any:
        return value
    raise TypeError(f"{name}: unsupported field type {kind}")


def replace_path(config: Any, dotted: str, value: Any) -> Any:
    """A copy of a config tree with one leaf (``"learner.lr"``) replaced, type-checked."""
    return apply_overrides(config, {dotted: value})


def apply_overrides(config: Any, overrides: Mapping[str, Any]) -> Any:
    """A copy of a config tree with every ``{"section.field": value}`` applied and
    type-checked. Each section is rebuilt once with all its new values, so a rule between
    two fields of a section (``__post_init__``) sees them together, whatever the order."""
    tree: dict[str, Any] = {}
    for dotted, value in overrides.items():
        node = tree
        *sections, leaf = dotted.split(".")
        for part in sections:
            node = node.setdefault(part, {})
        node[leaf] = value
    return _apply_tree(config, tree, "")


def _apply_tree(config: Any, tree: Mapping[str, Any], prefix: str) -> Any:
    names = {f.name for f in dataclasses.fields(config)}
    changes = {}
    for key, value in tree.items():
        dotted = prefix + key
        if key not in names:
            nearest = _nearest(key.replace("-", "_"), leaf_names(type(config)))
            meant = f"; did you mean {' or '.join(repr(prefix + n) for n in nearest)}?"
            raise ValueError(
                f"unknown config key {dotted!r} in {type(config).__name__}"
                + (meant if nearest else "")
                + f"; valid: {sorted(names)}"
            )
        current = getattr(config, key)
        if dataclasses.is_dataclass(current):
            shorthand = getattr(current, "SHORTHAND", None)
            if not isinstance(value, Mapping) and shorthand:  # `wandb: disabled`
                value = {shorthand: value}
            if not isinstance(value, Mapping):
                raise ValueError(f"{dotted} is a section: give it fields ({dotted}.<field>)")
            changes[key] = _apply_tree(current, value, dotted + ".")
        elif isinstance(value, Mapping):
            raise ValueError(
                f"{dotted} is a value, not a section: {dotted}.{next(iter(value))} goes too deep"
            )
        else:
            changes[key] = _convert(value, _hints(type(config))[key], dotted)
    try:
        return dataclasses.replace(config, **changes)
    except (TypeError, ValueError) as err:  # the section's own checks (__post_init__)
        message = _in_section(str(err), type(config).__name__, prefix, names)
        raise (TypeError if isinstance(err, TypeError) else ValueError)(message) from None


def _in_section(message: str, class_name: str, prefix: str, fields: set[str]) -> str:
    """A section's error message with the section's dotted name in it: its own checks
    name a field ("temperature must be >= 0") or the class ("GeneratorConfig.top_p
    takes ..."), and several sections have fields of the same name."""
    if not prefix or message.startswith(prefix):
        return message
    if message.startswith(class_name + "."):
        return prefix + message[len(class_name) + 1 :]
    first = message.split(" ", 1)[0].rstrip(":,")
    if first in fields:
        return prefix + message
    return f"{prefix.rstrip('.')}: {message}"


def _flatten(mapping: dict, prefix: str = ""):
    for key, value in mapping.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


# Names other RL libraries give a setting, and ours (``learner.learning_rate`` -> ``lr``).
SYNONYMS: dict[str, tuple[str, ...]] = {
    "learning_rate": ("lr",),
    "n": ("group_size",),
    "rollout_n": ("group_size",),
    "num_generations": ("group_size",),
    "num_samples": ("group_size", "samples"),
    "max_steps": ("steps",),
    "num_steps": ("steps",),
    "total_steps": ("steps",),
    "total_training_steps": ("steps",),
    "kl_coeff": ("kl_coef",),
    "kl_beta": ("kl_coef",),
    "beta": ("kl_coef",),
    "clip_ratio": ("clip_low", "clip_high"),
    "epsilon": ("eps", "clip_low"),
    "max_tokens": ("max_new_tokens",),
    "max_response_length": ("max_new_tokens",),
    "top_k": ("topk",),
    "retrieval_topk": ("topk",),
    "model_name": ("model", "name"),
    "model_path": ("model",),
    "batch_size": ("groups_per_step", "batch_size"),
    "train_batch_size": ("groups_per_step",),
}


def leaf_names(cls: type) -> list[str]:
    """The dotted name of every setting (leaf field) of a config class tree."""
    return [name for name, *_ in _leaves(cls)]


def _is_leaf(cls: type, dotted: str) -> bool:
    return dotted in _leaf_set(cls)


@functools.cache
def _leaf_set(cls: type) -> frozenset[str]:
    return frozenset(leaf_names(cls))


def unknown_setting(
    cls: type, dotted: str, foreign: Mapping[str, str] | None = None, dash: str = ""
) -> str:
    """Why ``dotted`` is no setting of the config tree ``cls``, and what the user may have
    meant: a section another config has (``foreign``: its sentence), a field missing from
    a section (with the nearest fields, or the section's list), or the nearest settings of
    the whole tree (a typo, another library's name: :data:`SYNONYMS`)."""
    parts = dotted.replace("-", "_").split(".")
    node, depth = cls, 0
    hints = _hints(node)
    while depth < len(parts) - 1 and dataclasses.is_dataclass(hints.get(parts[depth])):
        node = hints[parts[depth]]
        hints, depth = _hints(node), depth + 1
    section = ".".join(parts[:depth])
    name = ".".join(parts)
    if depth == 0 and parts[0] in (foreign or {}) and len(parts) > 1:
        return foreign[parts[0]]
    if parts[depth] in hints and depth < len(parts) - 1:
        return f"{dash}{'.'.join(parts[: depth + 1])} is a value, not a section"
    if parts[depth] in hints and dataclasses.is_dataclass(hints[parts[depth]]):
        return f"{dash}{name} is a section: give one of its settings ({dash}{name}.<field>)"
    local = [f"{section}.{n}" if section else n for n in leaf_names(node)]
    near = _nearest(name, local)
    guess = near or _nearest(name, leaf_names(cls))
    if section and _is_leaf(cls, parts[depth]) and parts[depth] not in guess:
        guess = [*guess, parts[depth]]  # --wandb.name: the run's own --name
    meant = f"; did you mean {' or '.join(dash + g for g in guess)}?" if guess else ""
    if not section:
        return f"no such setting{meant}" + ("" if guess else f" ({dash}help lists them all)")
    if near:
        return f"{section} has no setting {parts[depth]!r}{meant}"
    fields = ", ".join(dash + n for n in local)
    return f"{section} has no setting {parts[depth]!r}; its settings: {fields}{meant}"


def _nearest(name: str, candidates: Sequence[str]) -> list[str]:
    """Up to three of ``candidates`` that ``name`` most likely meant: close as a whole, else
    a setting whose own name (the last part) is ``name``'s, a synonym of it, or close."""
    import difflib

    def ratio(candidate: str) -> float:
        return difflib.SequenceMatcher(None, name, candidate).ratio()

    scored = sorted(((ratio(c), c) for c in candidates), reverse=True)
    if scored and scored[0][0] >= 0.75:  # the best, and any as good
        return [c for r, c in scored[:3] if r >= scored[0][0] - 0.02]
    last = name.rsplit(".", 1)[-1]
    by_leaf: dict[str, list[str]] = {}
    for c in candidates:
        by_leaf.setdefault(c.rsplit(".", 1)[-1], []).append(c)
    wanted = [last, *SYNONYMS.get(last, ())]
    exact = [c for w in wanted for c in by_leaf.get(w, [])]
    if exact:
        return exact[:3]
    near = difflib.get_close_matches(last, list(by_leaf), n=2, cutoff=0.8)
    return [c for w in near for c in by_leaf[w]][:3]


def parse_config(
    cls: type,
    argv: Sequence[str] | None = None,
    *,
    description: str | None = None,
    defaults: Any = None,
    default_config: str | Path | None = None,
    skip_sections: Sequence[str] = (),
    foreign_sections: Mapping[str, str] | None = None,
) -> Any:
    """Build ``cls`` from its defaults (or ``defaults``), the YAML file (``--config``, else
    ``default_config``) and the flags. ``skip_sections``: top-level keys of the YAML file
    that do not apply to ``cls`` (a file shared with other scripts) and are skipped.
    ``foreign_sections``: sections that other configs have and ``cls`` has not, each with
    the sentence that says where it belongs; a setting of one is refused with it. Any
    other unknown flag or key is refused with the nearest settings (did you mean)."""
    foreign = dict(foreign_sections or {})
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--config", type=Path, default=default_config)
    known, _ = first.parse_known_args(argv)
    base = defaults if defaults is not None else cls()
    file = None if known.config is None else Path(known.config)
    shorthands = _shorthands(cls)
    if file is not None:
        for key in _read_yaml(file, first, skip_sections):
            if not _is_leaf(cls, shorthands.get(key, key)):
                first.error(f"--config {file}: {unknown_setting(cls, key, foreign)}")
        base = _apply_yaml(base, file, first, skip_sections)
    parser = argparse.ArgumentParser(
        description=None if description is None else _plain(description),
        formatter_class=_HelpFormatter,
        # not argparse's list of every flag (a hundred lines) above each one-line error
        usage="%(prog)s [-h] [--config FILE.yaml] [--SECTION.FIELD VALUE ...]",
        allow_abbrev=False,  # --pipeline.step is refused (did you mean), not taken as steps
    )
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE.yaml",
        help="a YAML file of settings, nested like the config"
        + (f" (default: {default_config})" if default_config is not None else ""),
    )
    groups = {  # one per section, a section's before its subsections'; "run": the top level
        section: parser.add_argument_group(section or "run", summary or None)
        for section, summary in _sections(cls)
    }
    for name, kind, _default, doc in _leaves(cls):
        current = base
        for part in name.split("."):
            current = getattr(current, part)
        shown = current if not isinstance(current, tuple) else ",".join(map(str, current))
        short = [f"--{s}" for s, full in shorthands.items() if full == name]
        groups[name.rpartition(".")[0]].add_argument(
            f"--{name}",
            *short,
            dest=name,
            default=argparse.SUPPRESS,
            metavar=_metavar(kind),
            # argparse %-formats help text: a literal "%" (as in "30 %") must be doubled
            help=f"{_plain(doc)} (default: {shown})".replace("%", "%%"),
        )
    parsed, unknown = parser.parse_known_args(
        _joined_negatives(sys.argv[1:] if argv is None else argv)
    )
    if unknown:
        hints = [
            f"  {token.split('=')[0]}: {unknown_setting(cls, token.split('=')[0][2:], foreign, '--')}"
            for token in unknown
            if token.startswith("--")
        ]
        parser.error("\n".join([f"unrecognized arguments: {' '.join(unknown)}", *hints]))
    args = vars(parsed)
    args.pop("config", None)
    from_file = _read_yaml(file, first, skip_sections) if file is not None else {}
    overrides = {**{shorthands.get(k, k): v for k, v in from_file.items()}, **args}
    try:  # the file's settings and the flags together: rules between fields see both
        config = apply_overrides(defaults if defaults is not None else cls(), overrides)
    except (TypeError, ValueError) as err:
        said = [k for k in args if k in str(err)]  # the setting the message names: 'k=...'
        named = [k for k in said if f"{k}=" in str(err)] or said
        parser.error(f"{'--' + named[0] + ': ' if named else ''}{err}")
    try:  # checks across fields and sections, once everything is applied
        check_config(config)
    except ValueError as err:
        parser.error(str(err))
    return config


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The script's description as written (its examples are laid out by hand), each
    section's one-line description wrapped to the terminal."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return super()._fill_text(text, width, indent)
        return argparse.HelpFormatter._fill_text(self, text, width, indent)


def _sections(cls: type, prefix: str = "", doc: str = ""):
    """(dotted name, one-line description) of the config tree's sections: the tree itself
    (``""``) first, then every dataclass field, depth first. The description is the first
    paragraph of the section class's docstring (else of the field's)."""
    yield prefix.rstrip("."), _summary(cls) or _plain(doc)
    hints, docs = _hints(cls), field_docs(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _sections(hints[f.name], f"{prefix}{f.name}.", docs.get(f.name, ""))


def _summary(cls: type) -> str:
    """The first paragraph of ``cls``'s docstring as one line, or of its nearest base's
    (a run config that only adds a section has none); "" when none has one."""
    for klass in cls.__mro__[:-1]:  # not object's
        doc = klass.__dict__.get("__doc__")
        # @dataclass gives a class without a docstring its signature as one
        if doc and not doc.startswith(f"{klass.__name__}("):
            return _plain(" ".join(inspect.cleandoc(doc).split("\n\n")[0].split()))
    return ""


_ROLE = re.compile(r":(?:\w+:)*\w+:`([^`]+)`")  # :func:`x.y`, :py:class:`~x.Y`, :math:`a`
_LITERAL = re.compile(r"``(.+?)``")


def _plain(text: str) -> str:
    """Docstring text without its reST inline markup, for ``--help``: a role gives its
    target (``:func:`a.b``` -> ``a.b``; ``~a.b`` -> ``b``; ``title <a.b>`` -> ``title``),
    ````x```` gives ``x``."""
    return _LITERAL.sub(r"\1", _ROLE.sub(role_target, text))


def role_target(match: re.Match) -> str:
    """What a matched reST role (:data:`_ROLE`) shows: its target, ``~a.b`` as ``b`` and
    ``title <a.b>`` as ``title``."""
    role = match.group(1)
    if role.endswith(">") and "<" in role:
        return role.rpartition("<")[0].strip()
    return role[1:].rpartition(".")[2] if role.startswith("~") else role


def _shorthands(cls: type, prefix: str = "") -> dict[str, str]:
    """``{"wandb": "wandb.mode"}`` for every section whose class names a ``SHORTHAND``
    field: ``--wandb disabled`` (and ``wandb: disabled`` in YAML) sets that field."""
    out = {}
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            if getattr(kind, "SHORTHAND", None):
                out[prefix + f.name] = f"{prefix}{f.name}.{kind.SHORTHAND}"
            out.update(_shorthands(kind, f"{prefix}{f.name}."))
    return out


def _joined_negatives(argv: Sequence[str]) -> list[str]:
    """``--learner.betas -0.1,0.99`` as ``--learner.betas=-0.1,0.99``: argparse takes a
    value that starts with ``-`` for an option, unless it is a plain negative number."""
    out: list[str] = []
    for token in argv:
        if (
            out
            and out[-1].startswith("--")
            and "=" not in out[-1]
            and len(token) > 1
            and token[0] == "-"
            and (token[1].isdigit() or token[1] == ".")
        ):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def check_config(config: Any) -> None:
    """Call ``check()`` on every section that has one, innermost first."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            check_config(value)
    check = getattr(config, "check", None)
    if callable(check):
        check()


def _apply_yaml(
    config: Any, file: Path, parser: argparse.ArgumentParser, skip: Sequence[str]
) -> Any:
    """``config`` with the YAML file's settings (for ``--help`` to show)."""
    try:
        return apply_overrides(config, _read_yaml(file, parser, skip))
    except (TypeError, ValueError) as err:
        parser.error(f"--config {file}: {err}")


def _read_yaml(file: Path, parser: argparse.ArgumentParser, skip: Sequence[str]) -> dict:
    """The YAML file's settings as ``{"section.field": value}`` (``skip``: top-level keys
    that belong to other scripts)."""
    if not file.is_file():
        parser.error(f"--config {file}: no such file")
    try:
        data = read_yaml_file(file)
    except InputError as err:
        parser.error(f"--config {err}")
    if not isinstance(data, dict):
        parser.error(f"--config {file}: the top level must be a mapping of config keys")
    return {key: value for key, value in _flatten(data) if key.split(".")[0] not in skip}


def read_yaml_file(file: str | Path) -> Any:
    """The data of a YAML file the user named (safe: no tag runs code; a key given twice
    in one mapping is refused). Raises :class:`InputError` in one line that begins with
    ``file:line:column:`` (1-based, as editors count) for a syntax error, and names the
    file for one that is not UTF-8 (:class:`InputFileNotFoundError` when it is not a
    file); None for an empty file."""
    import yaml

    path = Path(file)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        before = err.object[: err.start]
        line, column = before.count(b"\n") + 1, err.start - before.rfind(b"\n")
        raise InputError(
            f"{file}:{line}:{column}: not UTF-8 (byte 0x{err.object[err.start]:02x}); save "
            "the file as UTF-8"
        ) from None
    except IsADirectoryError:
        raise InputFileNotFoundError(f"{file}: a folder, not a YAML file") from None
    except FileNotFoundError:
        raise InputFileNotFoundError(f"{file}: no such file") from None
    except OSError as err:
        raise InputError(f"{file}: cannot be read ({err.strerror or err})") from None
    try:
        return yaml.load(text, Loader=_unique_keys_loader())
    except yaml.YAMLError as err:
        raise InputError(yaml_error(file, err)) from None


def yaml_error(file: str | Path, err: Exception) -> str:
    """yaml's error as one line: ``file:line:column: not a readable YAML file: what is
    wrong (and where the construct it is in starts)``; yaml's own message spans several
    lines and ends with a caret under a copy of the line, which names nothing."""
    mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None)
    if mark is None or not problem:
        return f"{file}: not a readable YAML file: {' '.join(str(err).split())}"
    context, start = getattr(err, "context", None), getattr(err, "context_mark", None)
    if context and start is not None and (start.line, start.column) != (mark.line, mark.column):
        problem += f" ({context} that starts at line {start.line + 1}, column {start.column + 1})"
    elif context:
        problem += f" ({context})"
    if "'\\t'" in problem:
        problem += "; YAML indents with spaces, not tabs"
    what = "" if getattr(err, "ours", False) else "not a readable YAML file: "
    return f"{file}:{mark.line + 1}:{mark.column + 1}: {what}{problem}"


@functools.cache
def _unique_keys_loader() -> type:
    """yaml's SafeLoader, refusing a key given twice in one mapping (SafeLoader keeps the
    last and drops the first without a word: a section written twice loses its first)."""
    import yaml

    class UniqueKeys(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                try:
                    again = key in seen
                except TypeError:  # a key that cannot be hashed: yaml's own error, below
                    break
                if again:
                    err = yaml.constructor.ConstructorError(
                        None, None, f"{key!r} is given twice in one mapping (first at line "
                        f"{seen[key].line + 1}); merge the two", key_node.start_mark,
                    )  # fmt: skip
                    err.ours = True  # a sentence of its own, not a syntax error
                    raise err
                seen[key] = key_node.start_mark
            return super().construct_mapping(node, deep=deep)

    return UniqueKeys


def _metavar(kind: Any) -> str:
    """How ``--help`` shows what a flag takes: ``INT``, ``{a,b}`` (a Literal's choices),
    ``A,B`` (a pair; ``A,B,...`` for any number), ``...|none`` (None too)."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        return "|".join(_metavar(a) for a in args if a is not type(None)) + "|none"
    if origin is typing.Literal:
        return "{" + ",".join(map(str, args)) + "}"
    if origin is tuple and args and args[-1] is not Ellipsis:
        return ",".join("ABCDEFGHIJKLMNOPQRSTUVWXYZ"[: len(args)])
    if origin in (tuple, list):
        return "A,B,..."
    return getattr(kind, "__name__", "VALUE").upper()
