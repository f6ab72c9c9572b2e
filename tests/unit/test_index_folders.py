"""What an index folder holds is taken only when the settings asked for made it: leftover
shards, a whole index, a corpus of other settings are refused in one line (or rebuilt with
``overwrite``), a swapped ``corpus.arrow`` is caught by its sampled rows, damaged records
name their file, and the build and serve commands say all of it before Ray starts. No Ray:
workers=0 embeds in-process, and the commands are stopped before Ray would start."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("faiss")
pytest.importorskip("transformers")

from ray_credit import index as index_command  # noqa: E402
from ray_credit import serve as serve_command  # noqa: E402
from ray_credit.actors.corpus import Corpus  # noqa: E402
from ray_credit.actors.dense_index import IndexConfig  # noqa: E402
from ray_credit.actors.encoder import EncoderConfig  # noqa: E402
from ray_credit.actors.index_build import ensure_index  # noqa: E402
from ray_credit.actors.retriever import Retriever  # noqa: E402
from ray_credit.config import InputError  # noqa: E402
from tests.unit.test_retriever import CORPUS_DOCS  # noqa: E402

# another corpus of the same size: the same ids, other passages
OTHER_DOCS = [{"id": d["id"], "contents": f"Entry {i}\nA passage about item number {i}."}
              for i, d in enumerate(CORPUS_DOCS)]  # fmt: skip


def _jsonl(path, docs):
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


def _self_score(folder, row=3):
    """The score of a corpus passage searched with its own text (1.0 on its own index)."""
    retriever = Retriever.create(None, index_folder=folder)
    text = retriever.corpus.texts(row, row + 1)[0]
    hits = retriever.search([text], topk=1)[0]
    return hits[0]["id"], hits[0]["score"], retriever.corpus.hit(row, 0.0)["id"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Two whole index folders, of CORPUS_DOCS and of OTHER_DOCS, with the files made from."""
    root = tmp_path_factory.mktemp("built")
    a, b = _jsonl(root / "a.jsonl", CORPUS_DOCS), _jsonl(root / "b.jsonl", OTHER_DOCS)
    return {"a": a, "b": b, "index_a": ensure_index(a, root / "index_a"),
            "index_b": ensure_index(b, root / "index_b")}  # fmt: skip


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


# --------------------------------------------------------------------- leftover shards
def test_leftover_shards_of_another_corpus_are_refused_then_overwritten(tmp_path, built):
    folder = tmp_path / "out"
    ensure_index(built["b"], tmp_path / "scratch", shard_docs=5, keep_embeddings=True)
    folder.mkdir()
    shutil.copytree(tmp_path / "scratch" / "embeddings", folder / "embeddings")
    with pytest.raises(InputError, match=r"embeddings holds embeddings of other settings "
                       r"\(corpus_fingerprint .*--overwrite"):  # fmt: skip
        ensure_index(built["a"], folder, shard_docs=5)
    # the record lost: shards that nothing vouches for are refused too
    (folder / "embeddings" / "shards.json").unlink()
    with pytest.raises(InputError, match="no record of the corpus and encoder that made them"):
        ensure_index(built["a"], folder, shard_docs=5)
    ensure_index(built["a"], folder, shard_docs=5, overwrite=True)
    found, score, want = _self_score(folder)
    assert found == want and score == pytest.approx(1.0, abs=1e-4)


def test_shards_of_another_encoder_setting_are_refused(tmp_path, built):
    src = tmp_path / "scratch"
    ensure_index(built["a"], src, shard_docs=5, keep_embeddings=True,
                 encoder=EncoderConfig(name="minilm", max_length=64))  # fmt: skip
    folder = tmp_path / "out"
    folder.mkdir()
    shutil.copytree(src / "embeddings", folder / "embeddings")
    with pytest.raises(InputError, match=r"other settings \(encoder "):
        ensure_index(built["a"], folder, shard_docs=5)


# --------------------------------------------------------------------- a whole index
def test_a_whole_index_of_another_corpus_or_encoder_is_refused(tmp_path, built):
    folder = _copy(built["index_b"], tmp_path / "out")
    with pytest.raises(InputError, match=r"already holds a whole index of other settings "
                       r"\(corpus of 20 docs, fingerprint .*--overwrite"):  # fmt: skip
        ensure_index(built["a"], folder)
    with pytest.raises(InputError, match=r"other settings \(encoder.max_length 256 there, 64 "
                       "here"):  # fmt: skip
        ensure_index(built["b"], folder, encoder=EncoderConfig(name="minilm", max_length=64))
    with pytest.raises(InputError, match=r"index.kind 'flat' there, 'hnsw' here"):
        ensure_index(built["b"], folder, index=IndexConfig(kind="hnsw"))
    assert ensure_index(built["b"], folder) == folder.absolute()  # its own settings: kept
    ensure_index(built["a"], folder, overwrite=True)
    assert Corpus.open(folder).fingerprint == Corpus.open(built["index_a"]).fingerprint
    found, score, want = _self_score(folder)
    assert found == want and score == pytest.approx(1.0, abs=1e-4)


def test_the_build_command_refuses_another_index_and_says_nothing_to_do_for_its_own(
    tmp_path, built, capsys, monkeypatch
):
    monkeypatch.setitem(sys.modules, "ray", None)  # all of it before Ray
    folder = _copy(built["index_b"], tmp_path / "out")
    with pytest.raises(SystemExit) as exit:
        index_command.main(["--corpus", str(built["a"]), "--out", str(folder)])
    message = str(exit.value.code)
    assert message.startswith("python -m ray_credit.index build: error: ") and "\n" not in message
    assert "whole index of other settings" in message and "--overwrite" in message
    index_command.main(["--corpus", str(built["b"]), "--out", str(folder)])
    assert "holds a whole index of these settings; nothing to do" in capsys.readouterr().out


def test_overwrite_deletes_only_what_a_build_wrote(tmp_path, built):
    folder = _copy(built["index_b"], tmp_path / "out")
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match=r"holds files no build writes \(\['notes.txt'\]\)"):
        ensure_index(built["a"], folder, overwrite=True)
    assert (folder / "notes.txt").read_text() == "mine" and (folder / "manifest.json").is_file()


# --------------------------------------------------------------------- the corpus inside
def test_a_swapped_corpus_arrow_is_refused_where_the_index_is_opened(tmp_path, built):
    folder = _copy(built["index_a"], tmp_path / "out")
    shutil.copy(built["index_b"] / "corpus.arrow", folder / "corpus.arrow")  # json kept
    with pytest.raises(InputError, match=r"corpus.arrow is not the corpus corpus.json records"):
        Retriever.create(None, index_folder=folder)
    with pytest.raises(InputError, match="corpus.arrow is not the corpus"):
        serve_command.check_inputs(serve_command.ServeConfig(index_folder=str(folder)))
    # the whole pair swapped: corpus.json's fingerprint is not the manifest's
    shutil.copy(built["index_b"] / "corpus.json", folder / "corpus.json")
    with pytest.raises(InputError, match="records another corpus .* than the index"):
        Retriever.create(None, index_folder=folder)


def test_the_corpus_check_reads_a_few_rows_not_the_corpus(tmp_path):
    """The sampled-rows check costs the same at 20 and at 200,000 rows."""
    import time

    from ray_credit.actors.corpus import convert_corpus

    big = tmp_path / "big.jsonl"
    with big.open("w") as out:
        for i in range(200_000):
            out.write(json.dumps({"id": str(i), "contents": f"T{i}\npassage {i} " * 4}) + "\n")
    convert_corpus(big, tmp_path / "big")
    Corpus.open(tmp_path / "big")
    start = time.perf_counter()
    for _ in range(10):
        Corpus.open(tmp_path / "big")
    assert (time.perf_counter() - start) / 10 < 0.05  # a full read takes seconds here


# --------------------------------------------------------------------- damaged records
@pytest.mark.parametrize("record", ["corpus.json", "manifest.json"])
def test_a_cut_off_record_names_its_file_in_the_build(tmp_path, built, record):
    folder = _copy(built["index_a"], tmp_path / "out")
    text = (folder / record).read_text()
    (folder / record).write_text(text[: len(text) // 2])
    with pytest.raises(InputError, match=rf"{record} is not readable JSON .*line \d+ column "
                       r"\d+: cut off while written, or edited\); delete"):  # fmt: skip
        ensure_index(built["a"], folder)


def test_a_cut_off_manifest_is_one_line_in_serve(tmp_path, built, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    folder = _copy(built["index_a"], tmp_path / "out")
    text = (folder / "manifest.json").read_text()
    (folder / "manifest.json").write_text(text[:40])
    with pytest.raises(SystemExit) as exit:
        serve_command.main(["--index_folder", str(folder)])
    message = str(exit.value.code)
    assert "manifest.json is not readable JSON" in message and "\n" not in message


def test_serve_names_a_missing_index_folder(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(SystemExit) as exit:
        serve_command.main(["--index_folder", str(tmp_path / "no_such_folder")])
    assert "no_such_folder: no such folder" in str(exit.value.code)


def test_an_unwritable_out_is_one_line(tmp_path, built, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    place = "/sys/ray_credit_index"  # sysfs: not writable, even for root
    if os.access("/sys", os.W_OK) and os.path.isdir("/sys/kernel"):
        try:
            os.mkdir(place)
        except OSError:
            pass
        else:  # pragma: no cover - a machine whose /sys is writable
            os.rmdir(place)
            pytest.skip("/sys is writable here")
    with pytest.raises(SystemExit) as exit:
        index_command.main(["--corpus", str(built["a"]), "--out", place])
    message = str(exit.value.code)
    assert f"index folder {place} cannot be written" in message and "\n" not in message
    file = tmp_path / "a_file"
    file.write_text("x")
    with pytest.raises(InputError, match="is a file"):
        ensure_index(built["a"], file / "sub")


# ------------------------------------------------------------- a run given a folder
def test_a_run_given_a_folder_its_settings_did_not_make_is_refused_before_ray(built):
    """The run's encoder embeds the queries and the folder's the passages: with another
    encoder (of the same width, or another pooling) the search runs and finds nothing that
    matters. Refused before Ray, saying which flags make the run match the folder."""
    from dataclasses import replace

    from ray_credit.pipeline.configs import RunConfig
    from ray_credit.pipeline.preflight import check_index_settings

    cfg = RunConfig()
    retriever = replace(cfg.retriever, index_folder=str(built["index_a"]))
    check_index_settings(replace(cfg, retriever=retriever), str(built["a"]))  # as built
    cases = [
        ({"encoder": EncoderConfig(name="minilm", pooling="cls")},
         "encoder.pooling 'auto' there, 'cls' here", "--retriever.encoder.pooling auto"),
        ({"encoder": EncoderConfig(name="minilm", query_prefix="query: ")},
         "encoder.query_prefix None there, 'query: ' here",
         "--retriever.encoder.query_prefix null"),
        ({"index": IndexConfig(kind="hnsw")}, "index.kind 'flat' there, 'hnsw' here",
         "--retriever.index.kind flat"),
    ]  # fmt: skip
    for change, differs, flag in cases:
        run = replace(cfg, retriever=replace(retriever, **change))
        with pytest.raises(InputError) as err:
            check_index_settings(run, str(built["a"]))
        said = str(err.value)
        assert said.startswith(f"retriever.index_folder {built['index_a']} holds an index of "
                               f"other settings ({differs}"), said  # fmt: skip
        assert flag in said and said.endswith("or give another folder (a new one builds the "
                                              "index there)"), said  # fmt: skip
    # a corpus in memory (the synthetic world's) is compared here too
    with pytest.raises(InputError, match=r"\(corpus of \d+ docs, fingerprint .* there"):
        check_index_settings(replace(cfg, retriever=retriever), OTHER_DOCS)
