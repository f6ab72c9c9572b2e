"""The configuration reference as Markdown, generated from the config classes themselves.

Every setting a pipeline takes is a leaf field of a tree of frozen dataclasses
(:mod:`ray_credit.config`); its documentation is the string under the field. The
documentation site's configuration page is this module's output, rebuilt with the site,
so it cannot drift from the code: a field added, renamed or given a new default shows as
such at the next build.

    python -m ray_credit.config_reference > config.md     # the page, on its own

For each section (``learner``, ``learner.loss``, ``generator.vllm``, ...) the page gives
its description (the section class's docstring) and, for each setting, its command-line
flag, what it takes, its default, the value the embedded run's YAML file gives it where
that differs, and its documentation.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ray_credit.config import (
    _LITERAL,
    _ROLE,
    _flatten,
    _hints,
    _metavar,
    _summary,
    field_default,
    field_docs,
    read_yaml_file,
    role_target,
)

__all__ = ["markdown_text", "pipeline_runs", "reference_page", "section_markdown"]

_CODE = re.compile(r"(`[^`]*`)")


def markdown_text(text: str) -> str:
    """A docstring's reST inline markup as Markdown: ````x```` and roles become code
    spans (``:class:`~a.B``` -> ```B```), and outside them the characters Markdown or a
    table would read as markup (``\\``, ``<``, ``>``, ``*``, ``|``, ``[``) are escaped, so
    ``<search>`` shows as written."""
    text = _LITERAL.sub(r"`\1`", _ROLE.sub(lambda m: f"`{role_target(m)}`", text))
    parts = _CODE.split(text)
    for i in range(0, len(parts), 2):  # the even parts are outside code spans
        parts[i] = (
            parts[i]
            .replace("\\", "\\\\")
            .replace("<", "&lt;")
            .replace(">", "&gt;")
            .replace("*", "\\*")
            .replace("|", "\\|")
            .replace("[", "\\[")
        )
    return "".join(parts)


def _value(value: Any) -> str:
    """A setting's value as one writes it on the command line."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return ",".join(_value(v) for v in value) if value else "(empty)"
    if isinstance(value, str) and not value:
        return '""'
    return str(value)


def _code(text: str) -> str:
    fence = "``" if "`" in text else "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _takes(kind: Any) -> str:
    """What a setting takes, as code spans (``INT`` or ``none``)."""
    return " or ".join(_code(part) for part in _metavar(kind).split("|"))


def section_markdown(
    cls: type,
    prefix: str,
    *,
    embedded: Mapping[str, Any] | None = None,
    level: int = 2,
    doc: str = "",
    heading: bool = True,
) -> list[str]:
    """Markdown lines for the section ``cls`` at the dotted ``prefix`` (``""``: the run's
    own top-level settings) and, after its settings, each of its subsections one heading
    level down. ``embedded``: the embedded YAML's settings, flattened to dotted names;
    ``heading``: False where the caller writes the section's heading itself."""
    embedded = embedded or {}
    hints, docs = _hints(cls), field_docs(cls)
    fields = dataclasses.fields(cls)
    leaves = [f for f in fields if not dataclasses.is_dataclass(hints[f.name])]
    subsections = [f for f in fields if dataclasses.is_dataclass(hints[f.name])]
    lines: list[str] = []
    if prefix and heading:
        lines += [f"{'#' * level} `{prefix}`", ""]
    summary = _summary(cls) or doc  # a field docstring is one paragraph already
    if prefix and summary:  # the run's own: the page's introduction says it
        lines += [markdown_text(summary), ""]
    for f in leaves:
        name = f"{prefix}.{f.name}" if prefix else f.name
        lines += _setting(name, f, hints[f.name], docs, embedded, level=level + 1)
    for f in subsections:
        name = f"{prefix}.{f.name}" if prefix else f.name
        lines += section_markdown(
            hints[f.name],
            name,
            embedded=embedded,
            level=level + (1 if prefix else 0),
            doc=docs.get(f.name, ""),
        )
    return lines


def _setting(
    name: str,
    f: dataclasses.Field,
    kind: Any,
    docs: Mapping[str, str],
    embedded: Mapping[str, Any],
    *,
    level: int,
) -> list[str]:
    """One setting: its flag as a heading (anchored by its dotted name), what it takes,
    its default, the embedded run's value where that differs, its documentation."""
    default = field_default(f)
    facts = [_takes(kind), f"default {_code(_value(default))}"]
    if name in embedded and _value(embedded[name]) != _value(default):
        facts.append(f"embedded run {_code(_value(embedded[name]))}")
    lines = [f"{'#' * level} `--{name}` {{ #{name} }}", "", " · ".join(facts), ""]
    if docs.get(f.name):
        lines += [markdown_text(docs[f.name]), ""]
    return lines


def pipeline_runs(folder: str | Path) -> dict[str, type]:
    """``{"tspo": TSPORun, ...}``: the run config class of each pipeline script in
    ``folder`` (the dataclass it defines on top of
    :class:`~ray_credit.pipeline.RunConfig`), by the script's name. The scripts are
    imported, not run (each starts its job under ``if __name__ == "__main__"``)."""
    from ray_credit.pipeline import RunConfig

    runs = {}
    for path in sorted(Path(folder).glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"_pipeline_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses and inspect look the module up
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        found = [
            value
            for value in vars(module).values()
            if isinstance(value, type)
            and issubclass(value, RunConfig)
            and value is not RunConfig
            and value.__module__ == module.__name__
        ]
        if found:
            runs[path.stem] = found[0]
    return runs


def reference_page(runs: Mapping[str, type], embedded_yaml: str | Path | None = None) -> str:
    """The whole configuration page: the settings every pipeline shares
    (:class:`~ray_credit.pipeline.RunConfig`'s tree), then what each pipeline of ``runs``
    adds (its estimator's section)."""
    from ray_credit.pipeline import RunConfig
    from ray_credit.pipeline.configs import EMBEDDED_CONFIG

    source = Path(embedded_yaml or EMBEDDED_CONFIG)
    embedded = dict(_flatten(read_yaml_file(source) or {}))
    shared = {f.name for f in dataclasses.fields(RunConfig)}
    lines = [
        "# Configuration",
        "",
        "Every setting of every pipeline, generated from the config classes. A run takes",
        "the defaults below, then the YAML file of `--config` (the embedded run's,",
        f"`ray_credit/configs/{source.name}`, when none is given), then the command line:",
        "`--learner.micro_batch_tokens 2048`, or in YAML `learner: {micro_batch_tokens: 2048}`.",
        "Where the embedded run's file sets another value, it is given beside the default.",
        "`python pipelines/tspo.py --help` prints the same, with the file's values applied.",
        "",
        "## Run",
        "",
    ]
    lines += section_markdown(RunConfig, "", embedded=embedded, level=2)
    lines += ["## Estimators", "", "What each pipeline adds to the settings above.", ""]
    added: dict[tuple[str, type], list[str]] = {}  # (section, class) -> the scripts
    own: dict[str, list[dataclasses.Field]] = {}  # script -> settings of its own
    for script, cls in runs.items():
        hints = _hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in shared:
                continue
            if dataclasses.is_dataclass(hints[f.name]):
                added.setdefault((f.name, hints[f.name]), []).append(script)
            else:
                own.setdefault(script, []).append(f)
    names = [name for name, _ in added] + [f.name for fs in own.values() for f in fs]
    clash = sorted({name for name in names if names.count(name) > 1})
    if clash:
        raise ValueError(
            f"pipelines give the section(s) {clash} different config classes: one page "
            "cannot link to each setting of both"
        )
    for script, fs in own.items():
        docs = field_docs(runs[script])
        lines += [f"### `pipelines/{script}.py`", "", "Its own settings.", ""]
        for f in fs:
            lines += _setting(f.name, f, _hints(runs[script])[f.name], docs, embedded, level=4)
    for (name, kind), scripts in sorted(added.items(), key=lambda item: item[0][0]):
        where = ", ".join(f"`pipelines/{script}.py`" for script in scripts)
        lines += [f"### `{name}`", "", f"In {where}.", ""]
        lines += section_markdown(kind, name, embedded=embedded, level=3, heading=False)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    folder = Path(__file__).resolve().parents[1] / "pipelines"
    sys.stdout.write(reference_page(pipeline_runs(folder)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
