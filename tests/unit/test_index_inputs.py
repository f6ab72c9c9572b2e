"""Bad inputs to `python -m ray_credit.index build` and `python -m ray_credit.serve`, as a
Search-R1 user brings them: DPR's TSV with and without its header, damaged gzip and
parquet files, a corpus folder, an encoder path that holds no model, a build refused and
then run again with the input fixed, a port another program holds. Each is one line naming
the input and what to do, before Ray (which is never started here)."""

from __future__ import annotations

import gzip
import http.server
import json
import os
import socket
import sys
import threading

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("faiss")
pytest.importorskip("transformers")

from ray_credit import index as index_command  # noqa: E402
from ray_credit import serve as serve_command  # noqa: E402
from ray_credit.actors.corpus import Corpus, convert_corpus  # noqa: E402
from ray_credit.actors.index_build import ensure_index  # noqa: E402
from ray_credit.config import InputError  # noqa: E402
from ray_credit.data import DataFormatError, load_corpus  # noqa: E402

DOCS = [{"id": str(i), "contents": f"Title {i}\nPassage {i} about topic {i % 4}."}
        for i in range(12)]  # fmt: skip
DPR_ROWS = "".join(f'{i}\t"Passage {i} about ""topic"" {i % 4}."\tTitle {i}\n' for i in range(12))


@pytest.fixture
def no_ray(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)


def _jsonl(path, docs):
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


def _build_error(argv) -> str:
    with pytest.raises(SystemExit) as exit:
        index_command.main([str(a) for a in argv])
    message = str(exit.value.code)
    assert message.startswith("python -m ray_credit.index build: error: "), message
    assert "\n" not in message
    return message


# ---------------------------------------------------------------------------- DPR's TSV
def test_dprs_tsv_with_its_header_is_read_as_title_and_text(tmp_path):
    path = tmp_path / "psgs_w100.tsv"
    path.write_text("id\ttext\ttitle\n" + DPR_ROWS)
    docs = load_corpus(path)
    assert len(docs) == 12 and docs[3] == {"id": "3", "contents": 'Title 3\nPassage 3 about '
                                           '"topic" 3.'}  # fmt: skip
    gz = tmp_path / "psgs_w100.tsv.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert convert_corpus(gz, tmp_path / "out")["num_docs"] == 12
    assert Corpus.open(tmp_path / "out").hit(3, 0.0)["title"] == "Title 3"


def test_a_tsv_without_a_header_or_with_a_short_row_is_refused(tmp_path, no_ray):
    path = tmp_path / "psgs.tsv"
    path.write_text(DPR_ROWS)
    message = _build_error(["--corpus", path, "--out", tmp_path / "idx"])
    assert "psgs.tsv:1: a .tsv corpus needs a header row naming its columns" in message
    assert "['0', 'Passage 0 about \"topic\" 0.', 'Title 0']" in message
    assert "id<TAB>text<TAB>title" in message
    path.write_text("id\ttext\ttitle\n1\tonly two fields\n")
    with pytest.raises(DataFormatError, match=r"psgs.tsv:2: 2 tab-separated fields, and the "
                       r"header names 3"):  # fmt: skip
        load_corpus(path)


# ---------------------------------------------------------------------------- damaged files
@pytest.mark.parametrize(
    "name, content, message",
    [
        ("c.jsonl.gz", b'{"id": "1", "contents": "A\\nb"}\n', "gzip data is damaged or cut off"),
        ("c.jsonl.gz", gzip.compress(b'{"id": "1", "contents": "A\\nb"}\n' * 50)[:40],
         "gzip data is damaged or cut off"),
        ("c.parquet", b"not parquet", "c.parquet: not a readable parquet file"),
    ],
)  # fmt: skip
def test_a_damaged_corpus_file_is_one_line(tmp_path, no_ray, name, content, message):
    (tmp_path / name).write_bytes(content)
    assert message in _build_error(["--corpus", tmp_path / name, "--out", tmp_path / "idx"])


def test_a_corpus_folder_that_holds_no_converted_corpus_says_what_to_give(tmp_path, no_ray):
    (tmp_path / "wiki").mkdir()
    message = _build_error(["--corpus", tmp_path / "wiki", "--out", tmp_path / "idx"])
    assert "holds no converted corpus" in message and "give the corpus file (.jsonl" in message


def test_an_empty_passage_says_what_to_do(tmp_path):
    path = _jsonl(tmp_path / "c.jsonl", DOCS + [{"id": "x", "contents": ""}])
    with pytest.raises(DataFormatError, match=r"c.jsonl:13 \(id 'x'\): empty contents; give the "
                       "passage text, or drop it"):  # fmt: skip
        load_corpus(path)


# ---------------------------------------------------------------------------- the encoder
@pytest.mark.parametrize("what", ["missing", "file", "empty"])
def test_an_encoder_path_that_holds_no_model_is_refused_before_any_work(tmp_path, no_ray, what):
    corpus = _jsonl(tmp_path / "c.jsonl", DOCS)
    encoder = {"missing": tmp_path / "no_model", "file": corpus, "empty": tmp_path / "empty"}[what]
    (tmp_path / "empty").mkdir()
    message = _build_error(["--corpus", corpus, "--out", tmp_path / "idx",
                            "--encoder.name", encoder])  # fmt: skip
    why = {"missing": "no such folder", "file": "a file, not a model folder",
           "empty": "a folder with no config.json"}[what]  # fmt: skip
    assert f"--encoder.name {encoder}: {why}; give a sentence-transformers" in message
    assert not (tmp_path / "idx").exists()
    with pytest.raises(SystemExit) as exit:
        serve_command.main(["--corpus", str(corpus), "--encoder.name", str(encoder)])
    assert f"--encoder.name {encoder}: {why}" in str(exit.value.code)


def test_a_build_refused_midway_is_built_when_run_again_with_the_input_fixed(tmp_path, no_ray):
    """A build whose corpus was refused, or whose encoder failed to load, embedded nothing:
    the rerun with the corpus or the encoder fixed builds (it was refused as a partial
    build of other settings, to be --overwrite'n)."""
    corpus = _jsonl(tmp_path / "c.jsonl", DOCS + [DOCS[3]])
    message = _build_error(["--corpus", corpus, "--out", tmp_path / "idx"])
    assert "duplicate document ids ['3']" in message
    _jsonl(corpus, DOCS)
    index_command.main(["--corpus", str(corpus), "--out", str(tmp_path / "idx")])
    assert len(Corpus.open(tmp_path / "idx")) == 12
    # a model folder without weights: the load fails in one line, after the conversion
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    (weightless / "config.json").write_text('{"model_type": "bert", "hidden_size": 32}')
    message = _build_error(["--corpus", corpus, "--out", tmp_path / "idx2",
                            "--encoder.name", weightless])  # fmt: skip
    assert f"cannot load encoder '{weightless}'" in message
    assert ensure_index(corpus, tmp_path / "idx2") == (tmp_path / "idx2").absolute()


# ---------------------------------------------------------------------------- serve's port
def test_serve_refuses_a_port_another_program_holds(tmp_path, no_ray):
    corpus = _jsonl(tmp_path / "c.jsonl", DOCS)
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(SystemExit) as exit:
            serve_command.main(["--corpus", str(corpus), "--port", str(port)])
        message = str(exit.value.code)
        assert (
            message.startswith("python -m ray_credit.serve: error: --port ") and "\n" not in message
        )
        assert f"127.0.0.1:{port} is in use by another program" in message
    serve_command.check_port("127.0.0.1", port)  # free again


def test_a_port_a_ray_serve_proxy_holds_passes(tmp_path):
    """A Serve already running on the cluster keeps its port: its proxy answers /-/routes."""

    class Proxy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200 if self.path == "/-/routes" else 404)
            self.end_headers()
            self.wfile.write(b'{"/retrieve": "retriever"}')

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Proxy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        serve_command.check_port("127.0.0.1", server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(InputError, match="in use by another program"), socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        serve_command.check_port("0.0.0.0", other.getsockname()[1])
