"""StoragePath: one location, named by an absolute path or a URI, that every process
reads and writes the same way (local paths, file:// URIs, and pyarrow's in-memory mock://
filesystem standing in for an object store: no folders to rename, no local path)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from ray_credit.storage import StoragePath


def test_a_relative_path_is_absolute_from_where_it_was_made(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs = StoragePath("runs") / "tspo"
    assert str(runs) == str(tmp_path / "runs" / "tspo") and runs.is_local
    elsewhere = tmp_path / "worker"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # a worker in another working directory gets the same folder
    shipped = pickle.loads(pickle.dumps(runs))
    assert shipped == runs and Path(shipped) == tmp_path / "runs" / "tspo"
    (shipped / "step_000001" / "pipeline.json").write_text("{}")  # its folders are made
    assert (tmp_path / "runs" / "tspo" / "step_000001" / "pipeline.json").read_text() == "{}"
    assert not (elsewhere / "runs").exists()


def test_file_uris_read_write_list_rename_and_delete(tmp_path):
    root = StoragePath(f"file://{tmp_path}/store")
    assert root.is_local and root.local_path == tmp_path / "store"
    (root / "a" / "x.json").write_text('{"k": 1}')
    (root / "b").write_bytes(b"\x00\x01")
    assert str(root / "a") == f"file://{tmp_path}/store/a"  # a URI stays one
    assert [p.name for p in root.iterdir()] == ["a", "b"]
    assert (root / "a").is_dir() and (root / "b").is_file() and not (root / "c").exists()
    assert (root / "a" / "x.json").read_text() == '{"k": 1}'
    (root / "a").rename(root / "c")
    assert (tmp_path / "store" / "c" / "x.json").is_file() and not (root / "a").exists()
    (root / "c").delete()
    (root / "b").delete()
    (root / "missing").delete()  # absent is fine
    assert root.iterdir() == [] and (root / "nowhere").iterdir() == []
    with root.as_directory() as local, root.staged_directory() as staged:
        assert local == staged == tmp_path / "store"  # local: the folder itself, no copies


def test_an_object_store_is_written_through_a_local_staging_folder(tmp_path):
    root = StoragePath("mock:///bucket/runs")  # one in-memory filesystem for this root
    assert not root.is_local and root.local_path is None
    with pytest.raises(TypeError, match="mock:///bucket/runs/x is not on this machine"):
        os.fspath(root / "x")
    with (root / "learner").staged_directory() as local:
        (local / "model").mkdir()
        (local / "model" / "config.json").write_text("{}")
        (local / "learner_state.pt").write_bytes(b"state")
        assert not (root / "learner").exists()  # uploaded when the block ends
    assert not local.exists()  # the staging folder is gone
    assert (root / "learner" / "model" / "config.json").read_text() == "{}"
    with (root / "learner").as_directory() as copy:
        assert (copy / "learner_state.pt").read_bytes() == b"state"
        assert (copy / "model" / "config.json").is_file()
    assert not copy.exists()
    with pytest.raises(RuntimeError, match="cut"), (root / "cut").staged_directory() as local:
        (local / "half").write_text("x")
        raise RuntimeError("cut")  # a failed block uploads nothing
    assert not (root / "cut").exists()
    missing = "mock:///bucket/runs/nothing does not exist"
    with pytest.raises(FileNotFoundError, match=missing), (root / "nothing").as_directory():
        pass


def test_uri_options_stay_after_the_path_and_bad_locations_are_named():
    runs = StoragePath("s3://bucket/runs?region=eu-west-1&endpoint_override=localhost:9000")
    assert str(runs / "tspo" / "step 1") == (
        "s3://bucket/runs/tspo/step%201?region=eu-west-1&endpoint_override=localhost:9000"
    )
    assert pickle.loads(pickle.dumps(runs / "tspo")) == runs / "tspo"
    with pytest.raises(ValueError, match="nosuch://x/y: pyarrow cannot open this location"):
        StoragePath("nosuch://x/y").exists()
    with pytest.raises(ValueError, match="a path or a URI"):
        StoragePath("  ")
