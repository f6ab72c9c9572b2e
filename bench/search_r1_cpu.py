"""Run Search-R1's own ``retrieval_server.py`` on a CPU-only machine, unmodified.

    python bench/search_r1_cpu.py --port 8123 --threads 1 PATH/retrieval_server.py -- \
        --index_path I --corpus_path C --topk 3 --retriever_name minilm --retriever_model M

That script moves its encoder and every batch to CUDA, halves the encoder's weights, and
listens on a hard-coded port 8000. This launcher changes only that, before running the
file as ``__main__``: ``Module.cuda`` / ``Tensor.cuda`` return the object unchanged and
``torch.cuda.empty_cache`` does nothing (CPU only); ``Module.half`` keeps float32 (a
CPU has no fast float16 matmul: half weights would slow the encoder and add nothing a
GPU's fp16 gives); ``uvicorn.run`` gets ``--port`` and the loopback host. The search,
the encoding and the HTTP handling are the script's own. ``bench/retrieve_load.py
--search-r1`` starts it this way. Needs the script's imports (``datasets``, ``faiss``,
``fastapi``, ``uvicorn``, ``transformers``).
"""

from __future__ import annotations

import argparse
import runpy
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("server", help="Search-R1's search_r1/search/retrieval_server.py")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("server_args", nargs=argparse.REMAINDER, help="after --: its own")
    args = parser.parse_args()

    import torch
    import uvicorn

    torch.set_num_threads(args.threads)
    torch.nn.Module.cuda = lambda self, *a, **k: self
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Module.half = lambda self: self
    torch.cuda.empty_cache = lambda: None
    serve = uvicorn.run

    def run_on_our_port(app, *_, **kwargs):
        kwargs.update(host="127.0.0.1", port=args.port, log_level="warning")
        serve(app, **kwargs)

    uvicorn.run = run_on_our_port
    rest = args.server_args[1:] if args.server_args[:1] == ["--"] else args.server_args
    sys.argv = [args.server, *rest]
    runpy.run_path(args.server, run_name="__main__")


if __name__ == "__main__":
    main()
