"""Sustained load on ``/retrieve``: C concurrent clients for D seconds, one query per request.

    python bench/retrieve_load.py                    # the Serve deployment: 64 clients, 60 s
    python bench/retrieve_load.py --search-r1 PATH/search_r1/search/retrieval_server.py
    python bench/retrieve_load.py --url http://127.0.0.1:8000/retrieve   # a running server

Every client sends its next request the moment the previous one is answered, until the
deadline; a request is a failure when it raises (connection reset, timeout) or answers
anything but 200 with one list of ``topk`` hits. Reports, per server: requests answered
and failed (by kind), queries/s, and latency p50 / p90 / p99 / max.

``--search-r1`` also starts Search-R1's own server (``bench/search_r1_cpu.py``: its script
unmodified, moved to CPU and to a free port) on the same corpus file, the same faiss
index file and the same MiniLM folder, loads it the same way, and reports Serve's
queries/s over its (one run, the servers loaded one after the other, never together).
Both are also sent one request without ``"return_scores"``; the status each answers is
recorded.

Corpus: the seeded synthetic people of ``bench/retriever.py`` (``--corpus bench``,
``--docs`` of them) or the project's synthetic world (``--corpus world``). The index is
MiniLM + faiss Flat IP, built once here. ``--check`` exits 1 when a request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


async def load(
    url: str, queries: list[str], *, clients: int, seconds: float, topk: int, client: str = "raw"
) -> dict:
    """``clients`` workers posting one query per request to ``url`` for ``seconds``, each on
    its own keep-alive connection: ``client="raw"`` (HTTP/1.1 on asyncio streams, ~50 us of
    CPU per request: on a shared 2-core machine the servers keep the CPU) or ``"httpx"``."""
    latencies: list[float] = []  # of every request answered, whatever its status
    failures: Counter[str] = Counter()
    ok = 0
    cursor = iter(range(10**12))
    deadline = time.perf_counter() + seconds
    post = _httpx_poster if client == "httpx" else _raw_poster

    async def worker() -> None:
        nonlocal ok
        async with post(url) as send:
            while time.perf_counter() < deadline:
                query = queries[next(cursor) % len(queries)]
                body = json.dumps({"queries": [query], "topk": topk, "return_scores": True})
                start = time.perf_counter()
                try:
                    status, payload = await send(body.encode())
                except (OSError, asyncio.IncompleteReadError, ValueError) as err:
                    failures[type(err).__name__] += 1
                    continue
                latencies.append(time.perf_counter() - start)
                if status != 200:
                    failures[f"HTTP {status}"] += 1
                    continue
                result = json.loads(payload).get("result")
                if isinstance(result, list) and len(result) == 1 and len(result[0]) == topk:
                    ok += 1
                else:
                    failures["malformed result"] += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    elapsed = time.perf_counter() - start
    ordered = sorted(latencies)

    def pct(p: float) -> float:
        return 1e3 * ordered[min(len(ordered) - 1, int(p * len(ordered)))] if ordered else 0.0

    return {
        "client": client,
        "requests_ok": ok,
        "requests_failed": sum(failures.values()),
        "failures": dict(failures),
        "seconds": elapsed,
        "queries_per_s": ok / elapsed,
        "latency_ms": {
            "p50": pct(0.50),
            "p90": pct(0.90),
            "p99": pct(0.99),
            "max": 1e3 * ordered[-1] if ordered else 0.0,
        },
    }


@contextlib.asynccontextmanager
async def _httpx_poster(url: str):
    import httpx

    async with httpx.AsyncClient(timeout=60) as client:

        async def send(body: bytes) -> tuple[int, bytes]:
            try:
                response = await client.post(
                    url, content=body, headers={"Content-Type": "application/json"}
                )
            except httpx.HTTPError as err:
                raise OSError(f"{type(err).__name__}: {err}") from err
            return response.status_code, response.content

        yield send


@contextlib.asynccontextmanager
async def _raw_poster(url: str):
    """POSTs on one HTTP/1.1 keep-alive connection, reopened after a failure."""
    parts = urlsplit(url)
    host, port, path = parts.hostname, parts.port or 80, parts.path or "/"
    head = f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
    conn: list = []  # [reader, writer] while open

    async def send(body: bytes) -> tuple[int, bytes]:
        if not conn:
            conn.extend(await asyncio.wait_for(asyncio.open_connection(host, port), 60))
        reader, writer = conn
        try:
            writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
            await writer.drain()
            status, headers = await asyncio.wait_for(_read_head(reader), 60)
            if headers.get("transfer-encoding") == "chunked":
                payload = await asyncio.wait_for(_read_chunked(reader), 60)
            else:
                payload = await reader.readexactly(int(headers.get("content-length", 0)))
        except (OSError, asyncio.IncompleteReadError, ValueError, asyncio.TimeoutError):
            writer.close()
            conn.clear()
            raise
        if headers.get("connection") == "close":
            writer.close()
            conn.clear()
        return status, payload

    try:
        yield send
    finally:
        if conn:
            conn[1].close()


async def _read_head(reader) -> tuple[int, dict[str, str]]:
    line = await reader.readline()
    if not line:
        raise ConnectionResetError("the server closed the connection")
    status = int(line.split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip().lower()
    return status, headers


async def _read_chunked(reader) -> bytes:
    out = bytearray()
    while size := int((await reader.readline()).split(b";")[0], 16):
        out += await reader.readexactly(size)
        await reader.readline()
    await reader.readline()
    return bytes(out)


def without_scores_status(url: str) -> int:
    """The status a request without ``return_scores`` gets (Search-R1's clients omit it)."""
    import httpx

    return httpx.post(url, json={"queries": ["who"], "topk": 1}, timeout=60).status_code


def start_search_r1(args, corpus_path: Path, index_file: Path, encoder: str):
    """Search-R1's server on a free port (bench/search_r1_cpu.py); its process and URL."""
    import httpx
    from retriever import free_port, wait_for_server

    server = Path(args.search_r1).expanduser()
    if not server.is_file():
        raise SystemExit(
            f"--search-r1 {server}: no such file; give Search-R1's retrieval_server.py"
        )
    try:
        import datasets  # noqa: F401 (the server imports it)
    except ImportError:
        raise SystemExit("--search-r1: its server needs `datasets`: pip install datasets") from None
    port = free_port()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    command = [sys.executable, str(ROOT / "bench" / "search_r1_cpu.py")]
    command += ["--port", str(port), "--threads", str(args.threads), str(server), "--"]
    command += ["--index_path", str(index_file), "--corpus_path", str(corpus_path)]
    command += ["--topk", str(args.topk), "--retriever_name", "minilm"]
    command += ["--retriever_model", encoder]
    process = subprocess.Popen(command, env=env)
    url = f"http://127.0.0.1:{port}/retrieve"
    body = {"queries": ["who"], "topk": 1, "return_scores": True}
    ready = lambda: httpx.post(url, json=body, timeout=5).status_code == 200  # noqa: E731
    wait_for_server(process, ready, "Search-R1's server", 300)
    return process, url


def measure(name: str, url: str, queries: list[str], args) -> dict:
    common = {"clients": args.clients, "topk": args.topk, "client": args.client}
    asyncio.run(load(url, queries, seconds=args.warmup, **common))
    result = asyncio.run(load(url, queries, seconds=args.seconds, **common))
    result = {"server": name, "url": url, **result, "without_scores": without_scores_status(url)}
    lat = result["latency_ms"]
    print(
        f"{name:<10} {result['requests_ok']:>7} ok {result['requests_failed']:>4} failed "
        f"{result['queries_per_s']:>8.1f} q/s  p50 {lat['p50']:.0f} ms  p90 {lat['p90']:.0f} ms  "
        f"p99 {lat['p99']:.0f} ms  max {lat['max']:.0f} ms  "
        f"(no return_scores: HTTP {result['without_scores']})",
        flush=True,
    )
    if result["failures"]:
        print(f"{name:<10} failures: {result['failures']}", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="load this /retrieve endpoint instead of starting Serve")
    parser.add_argument("--search-r1", help="Search-R1's retrieval_server.py, to compare with")
    parser.add_argument("--corpus", choices=("bench", "world"), default="bench")
    parser.add_argument("--docs", type=int, default=2000, help="documents (entities for world)")
    parser.add_argument("--queries", type=int, default=4096, help="distinct queries, cycled")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument(
        "--client", choices=("raw", "httpx"), default="raw",
        help="the load generator: raw HTTP/1.1 on asyncio streams (light: the servers keep the "
        "CPU of a shared machine) or httpx (~1 ms of CPU per request)",
    )  # fmt: skip
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds of load not counted")
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per server")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true", help="exit 1 when a request failed")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "retrieve_load.json"
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    setup = {
        k: getattr(args, k) for k in ("clients", "client", "seconds", "warmup", "topk", "threads")
    }
    results = []
    if args.url:
        queries = [f"who was born in {random.Random(i).randint(1700, 2000)}?" for i in range(256)]
        results.append(measure("given", args.url, queries, args))
    else:
        import ray
        import torch
        from retriever import bench_world, free_port, synthetic_world

        from ray_credit.actors.retrieval_server import serve_retriever
        from ray_credit.actors.retriever import Retriever, resolve_encoder_path

        make = synthetic_world if args.corpus == "world" else bench_world
        docs, queries = make(args.docs, args.queries, args.seed)
        workdir = Path(tempfile.mkdtemp(prefix="bench_retrieve_load_"))
        corpus_path, index_folder = workdir / "corpus.jsonl", workdir / "index"
        corpus_path.write_text("".join(json.dumps(d) + "\n" for d in docs))
        torch.set_num_threads(args.threads)
        Retriever.create(corpus_path, index_folder=index_folder)  # the one index both load
        setup.update(corpus=args.corpus, docs=len(docs), distinct_queries=len(queries))
        print(f"corpus: {len(docs)} docs; {len(queries)} distinct queries", flush=True)
        search_r1 = None
        if args.search_r1:
            search_r1 = start_search_r1(
                args, corpus_path, index_folder / "index.faiss", resolve_encoder_path("minilm")
            )
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
        try:
            url = serve_retriever(
                corpus_path, index_folder=index_folder, port=free_port(), num_cpus=args.threads
            )
            results.append(measure("serve", url, queries, args))
            from ray import serve

            serve.shutdown()
            if search_r1 is not None:
                results.append(measure("search_r1", search_r1[1], queries, args))
        finally:
            if search_r1 is not None:
                search_r1[0].terminate()
                search_r1[0].wait(timeout=30)
            ray.shutdown()
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "setup": setup,
        "results": results,
    }
    if len(results) == 2:
        report["ratio_serve_over_search_r1"] = (
            results[0]["queries_per_s"] / results[1]["queries_per_s"]
        )
        print(f"serve / search_r1: {report['ratio_serve_over_search_r1']:.2f}x queries/s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    failed = sum(r["requests_failed"] for r in results if r["server"] != "search_r1")
    return 1 if args.check and failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
