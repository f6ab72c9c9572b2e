"""The documentation site builds with no warning (broken links and anchors, pages left out
of the navigation, docstrings the API reference cannot read fail the build), and every
page of docs/ is in its navigation."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _nav_pages(nav) -> list[str]:
    pages = []
    for entry in nav:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_of_docs_is_in_the_navigation():
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    pages = set(_nav_pages(config["nav"]))
    written = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    generated = {"reference/config.md"}
    assert written | generated == pages


def test_the_site_builds_strictly(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    site = tmp_path / "site"
    config = (site / "reference" / "config" / "index.html").read_text()
    assert 'id="learner.micro_batch_tokens"' in config
    api = (site / "reference" / "api" / "index.html").read_text()
    assert 'id="ray_credit.estimators.tspo"' in api
    assert (site / "search" / "search_index.json").stat().st_size > 100_000
