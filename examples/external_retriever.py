"""Train against a retrieval server you already run (Search-R1's `retrieval_server.py`,
or anything answering its `/retrieve` JSON) instead of building an index here.

    python examples/external_retriever.py --url http://127.0.0.1:8000/retrieve
    python examples/external_retriever.py            # starts a stand-in server first

The generators get a `RemoteRetriever` (each actor its own client: timeouts, retries
with backoff, counters) and search the server; nothing is encoded or indexed in the
job. The same switch on every pipeline: `python pipelines/tspo.py --retriever.url URL`.

Without --url, a stand-in plays the existing server: a plain `http.server` (no Ray)
answering `/retrieve` over the synthetic world's corpus, the way a server from another
project would.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from ray_credit.actors.retrieval_server import (
    RemoteRetriever,
    parse_retrieve_request,
    retrieve_response,
)
from ray_credit.actors.retriever import Retriever
from ray_credit.data import make_world
from ray_credit.estimators.tspo import TSPOConfig
from ray_credit.pipeline.recipe import RunConfig, load_config, train

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", help="an existing /retrieve endpoint (default: a stand-in)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument(
        "--backend", choices=("vllm", "transformers"), default="vllm",
        help="the generators' sampler (the embedded settings' vllm; transformers starts "
        "in a second on a tiny model)",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--output-dir", help="where the run's outputs go (default: a temp "
                        "folder, removed at the end)")  # fmt: skip
    args = parser.parse_args()

    # TSPO's pipeline on the embedded settings, pointed at the server.
    out = None if args.output_dir else tempfile.TemporaryDirectory(prefix="external_retriever_")
    flags = {
        "--name": "external-retriever",
        "--model": args.model,
        "--generator.backend": args.backend,
        "--output_dir": args.output_dir or out.name,
        "--wandb": "disabled",
        "--data.eval_questions": 4,
        "--pipeline.steps": args.steps,
        "--pipeline.groups_per_step": 2,
        "--resources.learner_cpus": 1,
        "--resources.eval_cpus": 1,
        # the embedded warm-start fine-tunes SmolLM2 for minutes first; not what this shows
        "--warm_start.enabled": "false",
    }
    argv = [str(x) for item in flags.items() for x in item]
    cfg = load_config(
        TSPORun, "tspo", argv, default_config=ROOT / "pipelines/configs/embedded.yaml"
    )
    url = args.url or start_stand_in_server(cfg.data.world)
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
    if not args.url:
        print(f"the stand-in server answered {QUERIES_SERVED[0]} queries")


if __name__ == "__main__":
    main()
