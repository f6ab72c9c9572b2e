"""Checkpoint folders: where a save writes, when it counts, which are kept.

A ``checkpoint_dir`` (any :class:`~ray_credit.storage.StoragePath`: a local or shared
path, or a URI such as ``s3://bucket/runs/NAME/checkpoint``) holds one folder per saved
step, ``step_NNNNNN``, with the learner's part (``learner/``, written by the learner's
rank 0 wherever it runs), the buffered chunks (``buffer/``) and ``pipeline.json``.

The rule: **a step folder is a checkpoint once it has ``pipeline.json``**, which the
driver writes last, after checking that the learner's part is there. An object store has
no atomic rename, so there the step is written in place; on a local (or shared) filesystem,
where renaming is free, it is written as ``step_NNNNNN.tmp`` and renamed, so a folder with
a step's name is whole there too. A save cut off leaves a folder without
``pipeline.json`` (or a ``.tmp``), never picked up and deleted by the next save. Deleting a
checkpoint deletes its ``pipeline.json`` first, so a deletion cut off leaves no folder
that looks whole.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ray_credit.storage import StoragePath

__all__ = ["begin_save", "checkpoint_state", "checkpoints", "end_save", "resolve_checkpoint"]

STATE_FILE = "pipeline.json"
LEARNER_DIR = "learner"

Location = str | os.PathLike[str] | StoragePath


def _staging(root: StoragePath, step: int) -> tuple[StoragePath, StoragePath]:
    final = root / f"step_{step:06d}"
    return (root / f"{final.name}.tmp" if root.is_local else final), final


def begin_save(root: Location, step: int) -> StoragePath:
    """The empty folder a save of ``step`` writes into (see the module); on an object
    store, the step saved again stops being a checkpoint while it is rewritten."""
    staging, _ = _staging(StoragePath(root), step)
    _delete(staging)
    staging.mkdir()
    return staging


def end_save(root: Location, step: int, state: dict[str, Any], *, keep: int) -> StoragePath:
    """Complete the save :func:`begin_save` started: check the learner's part is there,
    write ``state`` as ``pipeline.json``, put the folder in place, then keep only the
    newest ``keep`` checkpoints (and delete what cut-off saves left). Returns the step's
    folder."""
    root = StoragePath(root)
    staging, final = _staging(root, step)
    if not (staging / LEARNER_DIR).is_dir():
        raise RuntimeError(
            f"checkpoint {final}: the learner's part ({staging / LEARNER_DIR}) is not there as "
            f"the driver sees it, so the learner wrote it on another node's disk: {root} is "
            "not shared by the nodes. Give checkpoints a location every node sees: "
            "--storage_path on a shared filesystem (NFS) or a URI such as s3://bucket/runs "
            "(or pipeline.checkpoint_dir)"
        )
    (staging / STATE_FILE).write_text(json.dumps(state, indent=2))
    if staging != final:  # a local filesystem: the whole folder takes the step's name
        old = root / f"{final.name}.old"  # the same step saved before, until replaced
        _delete(old)
        if final.exists():
            final.rename(old)
        staging.rename(final)
    kept = {path for _, path in checkpoints(root)[-keep:]}
    for child in root.iterdir():
        if child.name.startswith("step_") and child not in kept:
            _delete(child)
    return final


def _delete(folder: StoragePath) -> None:
    (folder / STATE_FILE).delete()  # first: a deletion cut off leaves no whole-looking folder
    folder.delete()


def checkpoints(folder: Location) -> list[tuple[int, StoragePath]]:
    """The whole checkpoints in ``folder`` (a ``checkpoint_dir``), oldest first, as
    ``(step, path)``: its ``step_NNNNNN`` folders that have ``pipeline.json``."""
    found = []
    for path in StoragePath(folder).iterdir():
        step = path.name[len("step_") :]
        if path.name.startswith("step_") and step.isdigit() and (path / STATE_FILE).is_file():
            found.append((int(step), path))
    return sorted(found, key=lambda found: found[0])


def resolve_checkpoint(folder: Location) -> StoragePath:
    """The checkpoint to resume from: the newest whole one in ``folder`` (a
    ``checkpoint_dir``), else ``folder`` itself when it is one (a step's folder, or a
    checkpoint written before they were kept per step). FileNotFoundError names the
    folder when it holds none."""
    path = StoragePath(folder)
    found = checkpoints(path)
    if found:
        return found[-1][1]
    if (path / STATE_FILE).is_file():
        return path
    cut = [p.name for p in path.iterdir() if p.name.startswith("step_")]
    note = f" (only {', '.join(cut)}: a save cut off before it finished)" if cut else ""
    raise FileNotFoundError(
        f"{path} holds no checkpoint{note}: a checkpoint folder has {STATE_FILE}, and a "
        "run's checkpoint_dir has step_NNNNNN folders that do"
    )


def checkpoint_state(folder: Location) -> dict[str, Any]:
    """What :meth:`~ray_credit.pipeline.Pipeline.save` wrote to ``pipeline.json`` in the
    checkpoint ``folder`` resolves to (:func:`resolve_checkpoint`): ``step``,
    ``policy_version``, ``config`` and the caller's ``metadata`` ({} when it saved none),
    among others."""
    path = resolve_checkpoint(folder) / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(
            f"{path} is not readable JSON ({err}); resume from an intact checkpoint"
        ) from None
    if not isinstance(state, dict):
        raise ValueError(f"{path} is not a pipeline checkpoint's state (a JSON object)")
    state.setdefault("metadata", {})
    return state
