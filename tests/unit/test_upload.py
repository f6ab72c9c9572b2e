"""What `ray job submit --working-dir .` uploads: the code, never the data beside it."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("include_gitignore", [True, False])
def test_data_and_indexes_stay_out_of_the_uploaded_working_directory(include_gitignore):
    """Ray matches each path against .gitignore (unless told to ignore it) and .rayignore:
    Search-R1's downloads under data/ (a 14 GB corpus, a 64 GB index) are never sent."""
    from ray._private.runtime_env.packaging import get_excludes_from_ignore_files

    excludes = get_excludes_from_ignore_files(ROOT, include_gitignore=include_gitignore)

    def excluded(relative: str) -> bool:
        return any(match(ROOT / relative) for match in excludes)

    for path in ("data/wiki-18.jsonl.gz", "data/e5_Flat.index", "data/part_aa",
                 "indexes/wiki18/index.faiss", "runs/tspo/metrics.jsonl"):  # fmt: skip
        assert excluded(path), path
    for path in ("pipelines/tspo.py", "pipelines/configs/search_r1.yaml", "ray_credit/qa.py"):
        assert not excluded(path), path
