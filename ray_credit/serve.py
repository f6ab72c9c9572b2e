"""Serve the retriever over HTTP: a Ray Serve ``POST /retrieve`` endpoint that speaks the
Search-R1 retrieval-server JSON (what Search-R1's ``retrieval_server.py`` serves).

    python -m ray_credit.serve --corpus corpus.jsonl
    python -m ray_credit.serve --corpus wiki.jsonl --encoder.name e5-base-v2 --num_gpus 1
    python -m ray_credit.serve --help                     # every setting

It connects to the Ray cluster of RAY_ADDRESS, else to one `ray start` runs on this
machine, else starts one; finds the index in --index_folder or the shared index cache, or
builds it there once (or imports --index_file), before any replica starts; deploys the
replicas, which open it memory-mapped; prints the URL and a curl line; and
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

from ray_credit.actors.index_build import BuildConfig
from ray_credit.actors.retrieval_server import RequestLimits
from ray_credit.actors.retriever import EncoderConfig, IndexConfig, check_index_folder
from ray_credit.config import InputError, check_fields, parse_config

__all__ = ["ServeConfig", "main"]

_PROG = "python -m ray_credit.serve"


@dataclass(frozen=True)
class ServeConfig:
    """One /retrieve deployment: the corpus, how to index it, where to listen."""

    corpus: str = ""
    """The FlashRAG / Search-R1 corpus to search (.jsonl, .jsonl.gz or .parquet, one {"id",
    "contents"} per document, contents = title line + text; or DPR's .tsv with its header
    row). Not needed when index_folder holds a whole index: it holds its corpus."""
    index_folder: str | None = None
    """Where the index is loaded from, or built once (None: the shared index cache,
    $RAY_CREDIT_CACHE/indexes, keyed by the corpus and the encoder and index settings).
    Replicas on several nodes need it on storage they all see."""
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    """The query and passage encoder."""
    index: IndexConfig = field(default_factory=IndexConfig)
    """The faiss index."""
    index_file: str | None = None
    """A faiss index built elsewhere on the corpus's line order (Search-R1's e5_Flat.index),
    imported into the index folder once: checked against the corpus and the encoder."""
    build: BuildConfig = field(default_factory=BuildConfig)
    """How the index is built, once, here, when the folder holds none (replicas only open
    it): --build.workers N embeds on a Ray Data pool of N encoder actors."""
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
    """Refuse a missing or unreadable corpus, an unusable index folder, a whole one that
    these settings would not serve (another corpus, encoder or index settings: the
    replicas would refuse it) and index settings that cannot work for the corpus
    (InputError), reading only the corpus's first document: before Ray starts, in one
    line."""
    from ray_credit.actors.corpus import count_docs
    from ray_credit.actors.dense_index import check_index_config, check_whole_folder, read_manifest
    from ray_credit.actors.encoder import encoder_dim
    from ray_credit.actors.index_build import (
        check_encoder_name,
        check_writable,
        made_by_differences,
        spell_differences,
    )
    from ray_credit.data.loaders import iter_corpus

    folder = cfg.index_folder
    if cfg.index_file is not None:
        from ray_credit.pipeline.preflight import check_index_part

        check_index_part("--index_file", cfg.index_file)
    if cfg.index_file is not None and not os.path.isfile(cfg.index_file):
        raise InputError(f"--index_file {cfg.index_file}: no such file")
    if folder is not None:
        check_index_folder(folder)
    whole = folder is not None and read_manifest(folder) is not None
    if cfg.corpus:
        try:
            first = next(iter_corpus(cfg.corpus, batch_size=1, check_duplicates=False), None)
        except InputError as err:
            raise type(err)(f"--corpus: {err}") from None
        if first is None:
            raise InputError(f"--corpus {cfg.corpus}: the file holds no document")
    elif folder is not None and not os.path.exists(folder):
        raise InputError(
            f"--index_folder {folder}: no such folder; give a folder that holds a whole index "
            "(`python -m ray_credit.index build --out FOLDER ...` makes one), or --corpus "
            "to build one there"
        )
    elif not whole:
        raise InputError(
            "--corpus is required (the FlashRAG .jsonl corpus to search), unless "
            "--index_folder holds a whole index"
            + (f"; {folder} holds none (no manifest.json)" if folder is not None else "")
        )
    if whole:  # checked as the replicas will open it
        manifest = check_whole_folder(folder)
        index_file = cfg.index_file and os.path.abspath(cfg.index_file)
        differ = made_by_differences(folder, manifest, cfg.corpus or None, cfg.encoder,
                                     cfg.index, index_file)  # fmt: skip
        if differ:
            raise InputError(
                f"--index_folder {folder} holds an index of other settings "
                f"({spell_differences(differ)}); serve it with the settings it was built "
                "with, or give another --index_folder"
            )
        check_port(cfg.host, cfg.port)
        return
    if folder is not None:
        check_writable(folder)  # the index is built there first
    check_encoder_name(cfg.encoder)
    if cfg.index_file is None:
        try:
            check_index_config(cfg.index, count_docs(cfg.corpus), encoder_dim(cfg.encoder))
        except InputError as err:
            raise InputError(f"--index.*: {err}") from None
    check_port(cfg.host, cfg.port)


def check_port(host: str, port: int) -> None:
    """Refuse a port another program listens on: Serve's proxy could not bind it, and a
    pipeline given the URL would reach that program. A Ray Serve proxy there passes (a
    Serve already running on this cluster keeps its own port); so does a host that is not
    this machine's (Serve says so itself)."""
    import errno
    import socket
    import urllib.request

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed one's TIME_WAIT
        try:
            sock.bind((host, port))
            return
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                return
    local = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(host, host)
    local = f"[{local}]" if ":" in local and not local.startswith("[") else local
    try:  # Serve's proxy answers /-/routes with its route table
        with urllib.request.urlopen(f"http://{local}:{port}/-/routes", timeout=2) as reply:
            if isinstance(json.loads(reply.read()), dict):
                return
    except (OSError, ValueError):
        pass
    raise InputError(
        f"--port {port}: {host}:{port} is in use by another program (not a Ray Serve proxy); "
        "give a free --port, or stop what listens there"
    )


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
        try:
            url = serve_retriever(
                os.path.abspath(cfg.corpus) if cfg.corpus else None,
                encoder=cfg.encoder,
                index=cfg.index,
                index_folder=cfg.index_folder and os.path.abspath(cfg.index_folder),
                index_file=cfg.index_file and os.path.abspath(cfg.index_file),
                build=cfg.build,
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
        except (InputError, FileNotFoundError) as err:  # found while building: one line too
            raise SystemExit(f"{_PROG}: error: {' '.join(str(err).split())}") from None
        info = serve.get_app_handle(cfg.name).info.remote().result()
        where = f"on GPUs {info['index_gpus']}" if info["index_on_gpu"] else (
            "memory-mapped" if info["index_mmapped"] else "in memory")  # fmt: skip
        print(f"index of {info['num_docs']} docs in {info['index_folder']} ({where})", flush=True)
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
