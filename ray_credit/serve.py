"""Serve the retriever over HTTP: a Ray Serve ``POST /retrieve`` endpoint that speaks the
Search-R1 retrieval-server JSON (what Search-R1's ``retrieval_server.py`` serves).

    python -m ray_credit.serve --corpus corpus.jsonl
    python -m ray_credit.serve --corpus wiki.jsonl --encoder.name e5-base-v2 --num_gpus 1
    python -m ray_credit.serve --help                     # every setting

It connects to the Ray cluster of RAY_ADDRESS, else to one `ray start` runs on this
machine, else starts one; deploys the retriever (loading the index from --index_folder or
the shared index cache, or building it there once); prints the URL and a curl line; and
serves until Ctrl-C or SIGTERM, then removes the deployment. A pipeline searches it with
--retriever.url URL. The corpus and the index folder are checked before Ray starts.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ray_credit.actors.retrieval_server import RequestLimits
from ray_credit.actors.retriever import EncoderConfig, IndexConfig, check_index_folder
from ray_credit.config import InputError, check_fields, parse_config

__all__ = ["ServeConfig", "main"]

_PROG = "python -m ray_credit.serve"


@dataclass(frozen=True)
class ServeConfig:
    """One /retrieve deployment: the corpus, how to index it, where to listen."""

    corpus: str = ""
    """The FlashRAG / Search-R1 corpus to search (.jsonl or .jsonl.gz, one {"id",
    "contents"} per line, contents = title line + text). Required."""
    index_folder: str | None = None
    """Where the index is loaded from, or built and saved (None: the shared index cache,
    $RAY_CREDIT_CACHE/indexes, keyed by the corpus and the encoder and index settings)."""
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    """The query and passage encoder."""
    index: IndexConfig = field(default_factory=IndexConfig)
    """The faiss index."""
    limits: RequestLimits = field(default_factory=RequestLimits)
    """What one request may ask for (over a limit: a 4xx naming it)."""
    host: str = "127.0.0.1"
    """Address Serve listens on (0.0.0.0: every interface). Serve's host and port are set
    when Serve first starts on a cluster; a running Serve keeps its own."""
    port: int = 8000
    """HTTP port."""
    name: str = "retriever"
    """Serve application name (several deployments need distinct names and routes)."""
    route_prefix: str = "/retrieve"
    """URL path of the endpoint."""
    num_replicas: int = 1
    """Replicas, each with its own encoder and index; requests are spread over them."""
    num_cpus: float = 1.0
    """CPUs per replica."""
    num_gpus: float = 0.0
    """GPUs per replica (the encoder, and the index with faiss-gpu, then run on it)."""
    max_ongoing_requests: int = 256
    """Requests one replica takes at once; large, so concurrent requests coalesce."""
    max_batch_queries: int = 256
    """Queries coalesced into one encoder + faiss call."""
    batch_wait_ms: float = 2.0
    """Longest wait for a batch to fill."""

    def __post_init__(self) -> None:
        check_fields(self)
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port must lie in [1, 65535], got {self.port}")
        if self.num_replicas < 1 or self.max_ongoing_requests < 1 or self.max_batch_queries < 1:
            raise ValueError(
                "num_replicas, max_ongoing_requests and max_batch_queries must be >= 1"
            )
        if self.num_cpus < 0 or self.num_gpus < 0 or self.batch_wait_ms < 0:
            raise ValueError("num_cpus, num_gpus and batch_wait_ms must be >= 0")
        if not self.route_prefix.startswith("/"):
            raise ValueError(f"route_prefix must start with '/', got {self.route_prefix!r}")


def check_inputs(cfg: ServeConfig) -> None:
    """Refuse a missing or unreadable corpus and an unusable index folder (InputError),
    reading only the corpus's first document: before Ray starts, in one line."""
    from ray_credit.data.loaders import iter_corpus

    if not cfg.corpus:
        raise InputError("--corpus is required: the FlashRAG .jsonl corpus to search")
    try:
        first = next(iter_corpus(cfg.corpus, batch_size=1, check_duplicates=False), None)
    except InputError as err:
        raise type(err)(f"--corpus: {err}") from None
    if first is None:
        raise InputError(f"--corpus {cfg.corpus}: the file holds no document")
    if cfg.index_folder is not None:
        check_index_folder(cfg.index_folder)


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the flags, check the inputs, deploy, serve until Ctrl-C / SIGTERM, clean up."""
    cfg = parse_config(ServeConfig, argv, description=__doc__)
    try:
        check_inputs(cfg)
    except InputError as err:  # the user's to fix: one line, as argparse's errors
        raise SystemExit(f"{_PROG}: error: {err}") from None
    import ray
    from ray import serve

    from ray_credit.actors.retrieval_server import serve_retriever

    if not ray.is_initialized():  # RAY_ADDRESS, else a `ray start` cluster here, else a new one
        ray.init()
    print(f"Ray: {ray.get_runtime_context().gcs_address}", flush=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` stops it as Ctrl-C does
    try:
        url = serve_retriever(
            os.path.abspath(cfg.corpus),
            encoder=cfg.encoder,
            index=cfg.index,
            index_folder=cfg.index_folder and os.path.abspath(cfg.index_folder),
            name=cfg.name,
            route_prefix=cfg.route_prefix,
            host=cfg.host,
            port=cfg.port,
            num_replicas=cfg.num_replicas,
            num_cpus=cfg.num_cpus,
            num_gpus=cfg.num_gpus,
            max_ongoing_requests=cfg.max_ongoing_requests,
            max_batch_queries=cfg.max_batch_queries,
            batch_wait_ms=cfg.batch_wait_ms,
            limits=cfg.limits,
        )
        info = serve.get_app_handle(cfg.name).info.remote().result()
        how = "loaded from" if info["index_loaded"] else "built in"
        print(f"index of {info['num_docs']} docs {how} {info['index_folder']}", flush=True)
        example = json.dumps({"queries": ["who wrote Hamlet?"], "topk": 3, "return_scores": True})
        print(f"serving {url}", flush=True)
        print(f"  curl -s {url} -H 'Content-Type: application/json' -d '{example}'", flush=True)
        print(f"  pipelines: --retriever.url {url}; Ctrl-C stops it", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopping", flush=True)
    finally:
        serve.delete(cfg.name)
        print(f"removed the deployment {cfg.name!r}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
