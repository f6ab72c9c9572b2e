"""Checkpoint folders: one per saved step, the newest whole one resumed, a save cut off
never picked up (Pipeline.save's layout; the saves themselves run in tests/ray)."""

from __future__ import annotations

import pytest

from ray_credit.pipeline import PipelineConfig, checkpoints, resolve_checkpoint


def _save(folder, name, state=True):
    (folder / name).mkdir(parents=True)
    if state:
        (folder / name / "pipeline.json").write_text("{}")


def test_the_newest_whole_checkpoint_is_resumed(tmp_path):
    _save(tmp_path, "step_000002")
    _save(tmp_path, "step_000010")  # numbers, not names: 10 after 2
    _save(tmp_path, "step_000011.tmp")  # a save cut off: never picked up
    _save(tmp_path, "step_000012", state=False)  # no state file: not a checkpoint
    _save(tmp_path, "step_x")
    assert [step for step, _ in checkpoints(tmp_path)] == [2, 10]
    assert resolve_checkpoint(tmp_path) == tmp_path / "step_000010"
    # a step's own folder is a checkpoint too, and so is one of the single-folder layout
    assert resolve_checkpoint(tmp_path / "step_000002") == tmp_path / "step_000002"
    _save(tmp_path, "old")
    assert resolve_checkpoint(tmp_path / "old") == tmp_path / "old"


def test_a_folder_without_a_whole_checkpoint_is_named(tmp_path):
    _save(tmp_path, "step_000003.tmp")
    with pytest.raises(FileNotFoundError, match=r"holds no checkpoint \(only step_000003.tmp"):
        resolve_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="nowhere holds no checkpoint: a checkpoint"):
        resolve_checkpoint(tmp_path / "nowhere")


def test_at_least_one_checkpoint_is_kept():
    with pytest.raises(ValueError, match="keep_checkpoints must be >= 1"):
        PipelineConfig(keep_checkpoints=0)
