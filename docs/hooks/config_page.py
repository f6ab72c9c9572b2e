"""MkDocs hook: the configuration reference page, generated from the config classes at
every build (ray_credit.config_reference), so that it cannot drift from the code."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
PAGE = "reference/config.md"


def on_files(files, config):
    from ray_credit.config_reference import pipeline_runs, reference_page

    text = reference_page(pipeline_runs(ROOT / "pipelines"))
    files.append(File.generated(config, PAGE, content=text))
    return files
