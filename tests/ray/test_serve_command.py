"""`python -m ray_credit.serve` as users run it: a subprocess connected to the shared
cluster (RAY_ADDRESS, as `ray job submit` sets it) serves /retrieve in the Search-R1 JSON
and removes its deployment when terminated."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("faiss")
httpx = pytest.importorskip("httpx")

from tests.unit.test_retriever import CORPUS_DOCS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NAME = "serve-command-test"
# Ray's Serve config models use deprecated pydantic Field arguments: noise, not ours.
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for(log: Path, pattern: str, proc: subprocess.Popen, timeout_s: float) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text())
        if found:
            return found
        if proc.poll() is not None:
            pytest.fail(f"the command exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        time.sleep(0.5)
    pytest.fail(f"no {pattern!r} within {timeout_s} s:\n{log.read_text()[-4000:]}")


@pytest.mark.e2e  # the command as users run it, Serve up and down: the second test command
def test_serve_command_answers_and_stops_cleanly(ray_cluster, tmp_path):
    from ray import serve

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(doc) + "\n" for doc in CORPUS_DOCS))
    env = {
        **os.environ,
        "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address,
        "HF_HUB_OFFLINE": "1",
    }
    command = [
        sys.executable, "-m", "ray_credit.serve", "--corpus", str(corpus),
        "--index_folder", str(tmp_path / "index"), "--name", NAME,
        "--route_prefix", "/serve-command", "--port", str(_free_port()), "--num_cpus", "0.5",
    ]  # fmt: skip
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = _wait_for(log, r"serving (http://\S+/serve-command)\n", proc, 300).group(1)
        text = log.read_text()
        assert f"index of 20 docs in {tmp_path / 'index'} (memory-mapped)" in text
        assert f"index: 20 passages, flat, in {tmp_path / 'index'}" in text  # built once, here
        assert f"curl -s {url} -H 'Content-Type: application/json'" in text
        body = {"queries": ["What is the capital of France?"], "topk": 2, "return_scores": True}
        response = httpx.post(url, json=body, timeout=60)
        assert response.status_code == 200, response.text
        (hits,) = response.json()["result"]
        assert len(hits) == 2 and set(hits[0]) == {"document", "score"}
        assert hits[0]["document"] == {"id": "paris", "contents": CORPUS_DOCS[0]["contents"]}
        proc.terminate()  # SIGTERM: as Ctrl-C
        assert proc.wait(timeout=120) == 0, log.read_text()[-4000:]
        assert f"removed the deployment {NAME!r}" in log.read_text()
        assert NAME not in serve.status().applications
    finally:
        if proc.poll() is None:
            proc.kill()
            serve.delete(NAME)
