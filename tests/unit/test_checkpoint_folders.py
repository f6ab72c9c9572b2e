"""Checkpoint folders: one per saved step, a checkpoint once its pipeline.json is written
(last), the newest whole one resumed, a save cut off never picked up, only the newest
kept; on a local folder and on an object store (pyarrow's in-memory mock:// filesystem:
nothing to rename there). Pipeline.save's own saves run in tests/ray."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ray_credit.pipeline import PipelineConfig, checkpoint_state, checkpoints, resolve_checkpoint
from ray_credit.pipeline.checkpointing import begin_save, end_save
from ray_credit.storage import StoragePath


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
    assert Path(resolve_checkpoint(tmp_path)) == tmp_path / "step_000010"
    # a step's own folder is a checkpoint too, and so is one of the single-folder layout
    assert Path(resolve_checkpoint(tmp_path / "step_000002")) == tmp_path / "step_000002"
    _save(tmp_path, "old")
    assert Path(resolve_checkpoint(tmp_path / "old")) == tmp_path / "old"


def test_a_folder_without_a_whole_checkpoint_is_named(tmp_path):
    _save(tmp_path, "step_000003.tmp")
    with pytest.raises(FileNotFoundError, match=r"holds no checkpoint \(only step_000003.tmp"):
        resolve_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="nowhere holds no checkpoint: a checkpoint"):
        resolve_checkpoint(tmp_path / "nowhere")


def test_at_least_one_checkpoint_is_kept():
    with pytest.raises(ValueError, match="keep_checkpoints must be >= 1"):
        PipelineConfig(keep_checkpoints=0)


def _save_step(root, step, keep=2, learner=True):
    """What Pipeline.save does around its writes: begin, the learner's part, end."""
    staging = begin_save(root, step)
    if learner:
        (staging / "learner" / "learner_state.pt").write_bytes(b"state %d" % step)
    return staging, end_save(root, step, {"step": step}, keep=keep)


@pytest.fixture(params=["local", "object_store"])
def root(request, tmp_path):
    if request.param == "local":
        return StoragePath(tmp_path / "checkpoint")
    return StoragePath(f"mock:///bucket/{tmp_path.name}/checkpoint")


def test_saves_keep_the_newest_and_a_cut_off_save_is_never_resumed(root):
    for step in (1, 2, 3):
        staging, final = _save_step(root, step)
        # a local folder is written under .tmp and renamed; an object store in place
        assert staging.name == (f"step_{step:06d}.tmp" if root.is_local else final.name)
    assert [step for step, _ in checkpoints(root)] == [2, 3]  # keep_checkpoints=2
    assert [p.name for p in root.iterdir()] == ["step_000002", "step_000003"]
    assert (resolve_checkpoint(root) / "learner" / "learner_state.pt").read_bytes() == b"state 3"
    assert checkpoint_state(root)["step"] == 3

    begin_save(root, 4)  # cut off: the learner's part and pipeline.json never written
    (root / ("step_000004.tmp" if root.is_local else "step_000004") / "learner").mkdir()
    assert resolve_checkpoint(root) == root / "step_000003"
    _save_step(root, 5, keep=1)  # the cut-off folder goes with the next save
    assert [p.name for p in root.iterdir()] == ["step_000005"]

    _save_step(root, 5, keep=1)  # the same step saved again replaces it
    assert [step for step, _ in checkpoints(root)] == [5]
    assert [p.name for p in root.iterdir()] == ["step_000005"]


def test_a_learner_part_the_driver_cannot_see_is_refused_naming_the_fix(root):
    """The learner wrote on its own node's disk: the driver's copy of the folder lacks it."""
    with pytest.raises(RuntimeError, match=r"learner's part .* not there(.|\n)*storage_path"):
        _save_step(root, 1, learner=False)
    assert checkpoints(root) == []  # no pipeline.json was written
    begin_save(root, 2)
    state = {"step": 2, "metadata": {"run_config": {"name": "x"}}}
    with pytest.raises(RuntimeError, match="learner's part"):
        end_save(root, 2, state, keep=2)


def test_a_state_file_that_is_not_json_is_named(tmp_path):
    _save(tmp_path, "step_000001")
    (tmp_path / "step_000001" / "pipeline.json").write_text("{cut")
    with pytest.raises(ValueError, match=r"step_000001/pipeline.json is not readable JSON"):
        checkpoint_state(tmp_path)
    (tmp_path / "step_000001" / "pipeline.json").write_text(json.dumps([1]))
    with pytest.raises(ValueError, match="not a pipeline checkpoint's state"):
        checkpoint_state(tmp_path)
