"""The configuration reference page is generated from the config classes: every setting of
every pipeline is on it, with its default, and docstring markup reads as written."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from ray_credit.config import leaf_names
from ray_credit.config_reference import (
    markdown_text,
    pipeline_runs,
    reference_page,
    section_markdown,
)

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class _Inner:
    """The inner section.

    More than its first paragraph."""

    depth: int = 3
    """How deep, in ``turns``."""


@dataclass(frozen=True)
class _Outer:
    mode: Literal["a", "b"] = "a"
    """Which one: :class:`~ray_credit.batch.TrajectoryBatch` rows or <search> calls."""
    limit: float | None = None
    """The limit (none: no limit)."""
    inner: _Inner = field(default_factory=_Inner)


def test_a_section_gives_each_setting_its_flag_type_default_embedded_value_and_doc():
    text = "\n".join(section_markdown(_Outer, "top", embedded={"top.inner.depth": 5}))
    assert "## `top`" in text
    assert "### `--top.mode` { #top.mode }" in text
    assert "`{a,b}` · default `a`" in text
    assert "`FLOAT` or `none` · default `none`" in text
    # the nested section a level down, its class's first paragraph only
    assert "### `top.inner`" in text and "The inner section." in text
    assert "More than its first paragraph" not in text
    assert "`INT` · default `3` · embedded run `5`" in text
    assert "How deep, in `turns`." in text


def test_the_embedded_value_is_left_out_where_it_equals_the_default():
    text = "\n".join(section_markdown(_Outer, "top", embedded={"top.inner.depth": 3}))
    assert "embedded run" not in text


def test_docstring_markup_becomes_markdown_and_angle_brackets_show_as_written():
    assert markdown_text(":class:`~ray_credit.batch.TrajectoryBatch` rows") == (
        "`TrajectoryBatch` rows"
    )
    assert markdown_text("``a|b`` or <search> | *x*") == "`a|b` or &lt;search&gt; \\| \\*x\\*"
    assert markdown_text(":func:`the batch <ray_credit.batch>`") == "`the batch`"


def test_the_page_has_every_setting_of_every_pipeline_with_its_default():
    runs = pipeline_runs(ROOT / "pipelines")
    assert {"tspo", "grpo", "cw_grpo", "search_p1", "igpo", "a2tgpo", "gigpo"} <= set(runs)
    page = reference_page(runs)
    for cls in runs.values():
        for name in leaf_names(cls):
            assert f"`--{name}` {{ #{name} }}" in page, name
    # each section once, whichever pipelines share it
    assert page.count("### `judge`") == 1
    lr = dataclasses.fields(runs["tspo"])  # a default read from the class, not written here
    learner = next(f for f in lr if f.name == "learner").default_factory()
    assert f"default `{learner.lr}`" in page.split("{ #learner.lr }")[1].split("\n\n")[1]


def test_two_pipelines_giving_one_section_different_classes_are_refused():
    from ray_credit.pipeline import RunConfig

    @dataclass(frozen=True)
    class A(RunConfig):
        extra: _Inner = field(default_factory=_Inner)

    @dataclass(frozen=True)
    class B(RunConfig):
        extra: _Outer = field(default_factory=_Outer)

    with pytest.raises(ValueError, match="extra"):
        reference_page({"a": A, "b": B})
