"""Train against a retrieval server you already run (Search-R1's `retrieval_server.py`,
or anything answering its `/retrieve` JSON) instead of building an index here.

    python examples/external_retriever.py --retriever.url http://127.0.0.1:8000/retrieve
    python examples/external_retriever.py            # starts a stand-in server first

The generators get a `RemoteRetriever` (each actor its own client: timeouts, retries
with backoff, counters) and search the server; nothing is encoded or indexed in the
job. The same switch on every pipeline: `python pipelines/tspo.py --retriever.url URL`.

Without --retriever.url, a stand-in plays the existing server: a plain `http.server`
(no Ray) answering `/retrieve` over the synthetic world's corpus, the way a server from
another project would.
"""

from __future__ import annotations

import json
import tempfile
import threading
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Literal

from ray_credit import (
    RemoteRetriever,
    Retriever,
    RunConfig,
    load_config,
    make_world,
    parse_config,
    parse_retrieve_request,
    retrieve_response,
    train,
)
from ray_credit.estimators.tspo import TSPOConfig

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class TSPORun(RunConfig):  # as pipelines/tspo.py
    tspo: TSPOConfig = field(default_factory=TSPOConfig)


QUERIES_SERVED = [0]  # by the stand-in


def start_stand_in_server(world_config) -> str:
    """A `/retrieve` server in a thread of this process; returns its URL."""
    retriever = Retriever.create(make_world(world_config).corpus, encoder="minilm")
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (the stdlib's name)
            try:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                queries, topk, scores = parse_retrieve_request(body)
            except ValueError as err:
                self._send(400, {"error": str(err)})
                return
            with lock:
                hits = retriever.search(queries, topk)
                QUERIES_SERVED[0] += len(queries)
            self._send(200, retrieve_response(hits, return_scores=scores))

        def _send(self, status, payload):
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}/retrieve"


@dataclass(frozen=True)
class RetrieverFlags:
    """What the generators search (a pipeline's --retriever.* of the same name)."""

    url: str | None = None
    """An existing /retrieve endpoint (None: a stand-in server started here)."""


@dataclass(frozen=True)
class GeneratorFlags:
    """The generators (a pipeline's --generator.* of the same name)."""

    backend: Literal["vllm", "transformers"] = "vllm"
    """The sampler: the embedded settings' vllm; transformers starts in a second on a tiny
    model."""


@dataclass(frozen=True)
class PipelineFlags:
    """The training run (a pipeline's --pipeline.* of the same name)."""

    steps: int = 2
    """Learner updates."""


@dataclass(frozen=True)
class Flags:
    """The run's policy and outputs (the pipelines' flags of the same names)."""

    model: str = "smollm2-135m"
    """Policy: an embedded name, an HF id or a folder."""
    output_dir: str | None = None
    """Where the run's outputs go (None: a temp folder, removed at the end)."""
    retriever: RetrieverFlags = field(default_factory=RetrieverFlags)
    generator: GeneratorFlags = field(default_factory=GeneratorFlags)
    pipeline: PipelineFlags = field(default_factory=PipelineFlags)


def main() -> None:
    args = parse_config(Flags, description=__doc__)  # --help: every flag, its default

    # TSPO's pipeline on the embedded settings, pointed at the server.
    out = None if args.output_dir else tempfile.TemporaryDirectory(prefix="external_retriever_")
    tspo_flags = {
        "--name": "external-retriever",
        "--model": args.model,
        "--retriever.url": args.retriever.url,  # checked as the pipeline checks it
        "--generator.backend": args.generator.backend,
        "--output_dir": args.output_dir or out.name,
        "--wandb": "disabled",
        "--data.eval_questions": 4,
        "--pipeline.steps": args.pipeline.steps,
        "--pipeline.groups_per_step": 2,
        "--resources.learner_cpus": 1,
        "--resources.eval_cpus": 1,
        # the embedded warm-start fine-tunes SmolLM2 for minutes first; not what this shows
        "--warm_start.enabled": "false",
    }
    argv = [str(x) for item in tspo_flags.items() for x in item]
    cfg = load_config(TSPORun, "tspo", argv)
    url = cfg.retriever.url or start_stand_in_server(cfg.data.world)
    with RemoteRetriever(url) as probe:  # what the generators will see
        top = probe.search(["Who founded the oldest city?"], 2)[0]
        print(f"server {url}: top hit {top[0]['title']!r} ({top[0]['score']:.3f})")
    try:
        summary = train(replace(cfg, retriever=replace(cfg.retriever, url=url)), "tspo")
    finally:
        if out is not None:
            out.cleanup()
    last = summary["final_step_metrics"]
    print(
        f"trained {summary['steps']} steps against the external retriever: "
        f"{last['gen/searches']:.0f} searches in the last step, "
        f"EM {summary['eval_before']['em']:.3f} -> {summary['eval_after']['em']:.3f}"
    )
    if not args.retriever.url:
        print(f"the stand-in server answered {QUERIES_SERVED[0]} queries")


if __name__ == "__main__":
    main()
