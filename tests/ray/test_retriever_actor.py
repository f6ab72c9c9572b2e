"""The retriever on Ray: request coalescing in the actor, the Serve /retrieve endpoint,
and RemoteRetriever against it. Uses the session's shared local cluster."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("faiss")
pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")

from ray_credit.actors.retrieval_server import RemoteRetriever, serve_retriever  # noqa: E402
from ray_credit.actors.retriever import make_retriever_actor  # noqa: E402
from tests.unit.test_retriever import CORPUS_DOCS, QUERIES  # noqa: E402

# Ray's Serve config models use deprecated pydantic Field arguments: noise, not ours.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def services(ray_cluster):
    """A retriever actor and a Serve /retrieve app over the same corpus, started together
    (each loads torch and the encoder in its own process: seconds apiece)."""
    from ray import serve

    actor = make_retriever_actor(CORPUS_DOCS, num_cpus=0.5, max_batch_queries=64, batch_wait_ms=50)
    url = serve_retriever(
        CORPUS_DOCS, name="retriever-test", port=_free_port(), num_cpus=0.5, batch_wait_ms=30
    )
    ray_cluster.get(actor.metrics.remote())  # the actor's index is built
    yield actor, url
    serve.delete("retriever-test")
    ray_cluster.kill(actor)


@pytest.fixture
def actor(services):
    return services[0]


@pytest.fixture
def retrieve_url(services):
    return services[1]


def test_concurrent_callers_are_coalesced(ray_cluster, actor):
    before = ray_cluster.get(actor.metrics.remote())
    queries = list(QUERIES) * 4
    refs = [actor.search.remote([q], 1 + i % 3) for i, q in enumerate(queries)]
    results = ray_cluster.get(refs)
    for i, (query, hits) in enumerate(zip(queries, results, strict=True)):
        assert len(hits) == 1 and len(hits[0]) == 1 + i % 3
        assert hits[0][0]["id"] == QUERIES[query]
    after = ray_cluster.get(actor.metrics.remote())
    batches = after["coalesced_batches"] - before["coalesced_batches"]
    assert after["requests"] - before["requests"] == len(queries)
    assert 1 <= batches < len(queries) / 2
    assert after["queries"] - before["queries"] == len(queries)
    assert after["failed_batches"] == 0


def test_actor_from_async_callers_and_bad_calls(ray_cluster, actor):
    async def callers():
        return await asyncio.gather(*(actor.search.remote([q, q], 2) for q in QUERIES))

    for query, hits in zip(QUERIES, asyncio.run(callers()), strict=True):
        assert [h[0]["id"] for h in hits] == [QUERIES[query]] * 2
    with pytest.raises(ValueError, match="exceeds the corpus size 20"):
        ray_cluster.get(actor.search.remote(["q"], 50))
    assert ray_cluster.get(actor.search.remote([], 3)) == []
    info = ray_cluster.get(actor.info.remote())
    assert info["num_docs"] == 20 and info["encoder_device"] == "cpu"
    assert not info["index_on_gpu"]
    # no index_folder given: the shared index cache of the actor's node
    assert os.path.basename(os.path.dirname(info["index_folder"])) == "indexes"
    assert info["encoder"]["pooling"] == "mean"


def test_serve_retrieve_speaks_search_r1_json(retrieve_url):
    from ray import serve

    assert retrieve_url.endswith("/retrieve")
    info = serve.get_app_handle("retriever-test").info.remote().result()
    # built once by serve_retriever before the replica started; the replica only opened it
    assert info["index_loaded"] and info["index_mmapped"] and info["num_docs"] == 20
    body = {"queries": ["What is the capital of France?"], "topk": 2, "return_scores": True}
    response = httpx.post(retrieve_url, json=body, timeout=30)
    assert response.status_code == 200, response.text
    (hits,) = response.json()["result"]
    assert len(hits) == 2 and set(hits[0]) == {"document", "score"}
    assert hits[0]["document"] == {"id": "paris", "contents": CORPUS_DOCS[0]["contents"]}
    plain = httpx.post(retrieve_url, json={"queries": ["Tokyo"], "topk": 1}, timeout=30)
    assert plain.json() == {"result": [[{"id": "tokyo", "contents": CORPUS_DOCS[10]["contents"]}]]}
    bad = httpx.post(retrieve_url, json={"queries": ["q"], "topk": 0}, timeout=30)
    assert bad.status_code == 400 and "topk must be" in bad.json()["error"]
    too_many = httpx.post(retrieve_url, json={"queries": ["q"], "topk": 21}, timeout=30)
    assert too_many.status_code == 400 and "corpus size" in too_many.json()["error"]
    garbled = httpx.post(retrieve_url, content=b"{not json", timeout=30)
    assert garbled.status_code == 400 and "not JSON" in garbled.json()["error"]


def test_remote_retriever_against_serve(retrieve_url):
    from ray import serve

    with RemoteRetriever(retrieve_url, timeout_s=30, retries=1) as client:
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda q: client.search([q], 3), list(QUERIES) * 2))
        metrics = client.metrics()
    for query, hits in zip(list(QUERIES) * 2, results, strict=True):
        assert hits[0][0]["id"] == QUERIES[query]
        assert set(hits[0][0]) == {"id", "contents", "title", "text", "score"}
    assert metrics["requests"] == 2 * len(QUERIES) and metrics["retries"] == 0
    server = serve.get_app_handle("retriever-test").metrics.remote().result()
    assert server["coalesced_batches"] < server["requests"]
    assert server["bad_requests"] == 3 and server["server_errors"] == 0


def test_serve_under_load_with_clients_walking_away(retrieve_url):
    """bench/retrieve_load.py's load, briefly: 32 clients for 3 s, while other clients send
    whole requests and hang up without reading the answer. Every loaded request is
    answered, and the server counts no error."""
    import json
    import sys
    from pathlib import Path

    from ray import serve

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from retrieve_load import load

    host, port = retrieve_url.split("//")[1].split("/")[0].split(":")
    body = json.dumps({"queries": ["Tokyo"] * 8, "topk": 3, "return_scores": True}).encode()
    request = (
        f"POST /retrieve HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body

    async def walk_away(times: int) -> None:
        for _ in range(times):
            _, writer = await asyncio.open_connection(host, int(port))
            writer.write(request)
            await writer.drain()
            writer.close()  # before the answer
            await asyncio.sleep(0.05)

    async def both() -> dict:
        loaded, _ = await asyncio.gather(
            load(retrieve_url, list(QUERIES), clients=32, seconds=3, topk=3), walk_away(20)
        )
        return loaded

    handle = serve.get_app_handle("retriever-test")
    before = handle.metrics.remote().result()
    result = asyncio.run(both())
    assert result["requests_failed"] == 0, result["failures"]
    assert result["requests_ok"] > 32 and result["latency_ms"]["p99"] > 0
    after = handle.metrics.remote().result()
    assert after["server_errors"] == before["server_errors"]
    assert after["bad_requests"] == before["bad_requests"]
    hits = httpx.post(retrieve_url, json={"queries": ["Tokyo"], "topk": 1}, timeout=30).json()
    assert hits["result"][0][0]["id"] == "tokyo"


# ---------------------------------------------------------------------------- building
@pytest.mark.e2e  # a Ray Data job of two encoder workers: the second test command
def test_a_ray_data_build_on_two_workers_returns_the_one_pass_top_k(ray_cluster, tmp_path):
    """Shards embedded by a pool of two encoder actors index to the same top-k as every
    passage embedded at once in this process."""
    from ray_credit.actors.corpus import Corpus
    from ray_credit.actors.dense_index import DenseIndex
    from ray_credit.actors.encoder import Encoder
    from ray_credit.actors.index_build import ensure_index
    from ray_credit.actors.retriever import Retriever

    folder = ensure_index(CORPUS_DOCS, tmp_path / "idx", workers=2, worker_cpus=0.5,
                          shard_docs=5)  # fmt: skip
    sharded = Retriever.create(None, index_folder=folder)
    corpus, encoder = Corpus(CORPUS_DOCS), Encoder("minilm")
    one_pass = Retriever(corpus, encoder, DenseIndex.build(corpus, encoder))
    top = [[h["id"] for h in hits] for hits in sharded.search(list(QUERIES), topk=5)]
    assert top == [[h["id"] for h in hits] for hits in one_pass.search(list(QUERIES), topk=5)]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["built"]["workers"] == 2 and manifest["num_docs"] == 20


def test_a_service_actor_that_fails_to_start_is_named_with_its_cause(ray_cluster):
    from ray_credit.actors.retriever import IndexConfig
    from ray_credit.pipeline.services import ServiceStartError, wait_started

    bad = make_retriever_actor(CORPUS_DOCS, num_cpus=0.25, max_restarts=0,
                               index=IndexConfig(kind="ivfflat", nlist=64, nprobe=4))  # fmt: skip
    with pytest.raises(ServiceStartError, match=r"^the retriever failed to start: InputError: "
                       r"index kind 'ivfflat' with nlist=64 .* the corpus has 20"):  # fmt: skip
        wait_started({"retriever": bad})


def test_an_index_in_slices_finds_what_the_whole_index_finds(ray_cluster, actor):
    """resources.retriever_gpu_share's retriever: the flat index in two slice actors, each
    in its bundle (here of CPUs: the share's GPUs are left out), searched as one."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    queries = list(QUERIES)
    group = placement_group([{"CPU": 0.25}] * 2)
    ray_cluster.get(group.ready())
    sliced = make_retriever_actor(CORPUS_DOCS, num_cpus=0.25, max_restarts=0,
                                  slices=([(group, 0), (group, 1)], 0.0, 0.25))  # fmt: skip
    try:
        info = ray_cluster.get(sliced.info.remote())
        assert len(info["index_gpus"]) == 2 and not info["index_on_gpu"]
        assert info["num_docs"] == len(CORPUS_DOCS)
        for topk in (1, 3, len(CORPUS_DOCS)):
            whole, parts = ray_cluster.get([actor.search.remote(queries, topk),
                                            sliced.search.remote(queries, topk)])  # fmt: skip
            assert [[h["id"] for h in q] for q in parts] == [[h["id"] for h in q] for q in whole]
            for q_parts, q_whole in zip(parts, whole, strict=True):
                assert [h["score"] for h in q_parts] == pytest.approx(
                    [h["score"] for h in q_whole], abs=1e-5
                )
        # the slices die with the retriever that owns them, and their bundles are free
        ray_cluster.kill(sliced)
        sliced = None
        probe = ray_cluster.remote(num_cpus=0.25)(_placed).options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, 1)
        )
        assert ray_cluster.get(probe.remote(), timeout=60) == "placed"
    finally:
        if sliced is not None:
            ray_cluster.kill(sliced)
        remove_placement_group(group)


def _placed() -> str:
    return "placed"


@pytest.mark.e2e  # three retriever actors: the second test command
def test_retriever_replicas_open_the_index_the_first_one_built(ray_cluster, tmp_path):
    from ray_credit.pipeline.configs import ResourcesConfig, RetrieverConfig
    from ray_credit.pipeline.services import make_retriever

    replicas = make_retriever(CORPUS_DOCS, RetrieverConfig(),
                              ResourcesConfig(retriever_replicas=2, retriever_cpus=0.25),
                              str(tmp_path / "idx"))  # fmt: skip
    infos = ray_cluster.get([r.handle.info.remote() for r in replicas])
    assert [i["index_loaded"] for i in infos] == [False, True]  # built once, then opened
    assert {i["index_folder"] for i in infos} == {str(tmp_path / "idx")}
    hits = ray_cluster.get([r.handle.search.remote(["capital of France"], 1) for r in replicas])
    assert hits[0] == hits[1] and hits[0][0][0]["id"] == "paris"
    for replica in replicas:
        ray_cluster.kill(replica.handle)
