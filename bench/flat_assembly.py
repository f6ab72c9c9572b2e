"""The peak memory of assembling a flat index from its shards of embeddings:

    python bench/flat_assembly.py                     # 1,000,000 x 768 (e5-base's width)
    python bench/flat_assembly.py --docs 200000 --dim 384 --out flat.json

Writes ``--docs`` seeded random vectors as the build's shards (``--shard_docs`` each, .npy,
float32) into a temporary folder, then assembles ``index.faiss`` from them twice, each in
a fresh process: **whole** (every shard added to one faiss IndexFlatIP, then
``faiss.write_index``: what index builds did, the whole index in memory) and
**streamed** (``ray_credit.actors.index_build._write_flat_file``: faiss's header, then
each shard's bytes as it is read). Reports each one's seconds and peak resident memory,
and whether the two files are the same bytes. Disk: the shards and two index files,
3 x 4 x docs x dim bytes (9.2 GB at the default).
"""

from __future__ import annotations

import argparse
import filecmp
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import resource, sys, time
from pathlib import Path
import numpy as np
sys.path.insert(0, {root!r})
folder, mode, docs, dim = Path({folder!r}), {mode!r}, {docs}, {dim}
shards = sorted(folder.glob("shard_*.npy"))
start = time.perf_counter()
if mode == "whole":
    import faiss
    index = faiss.IndexFlatIP(dim)
    for path in shards:
        index.add(np.ascontiguousarray(np.load(path, mmap_mode="r"), dtype=np.float32))
    faiss.write_index(index, str(folder / "whole.faiss"))
else:
    from ray_credit.actors.index_build import _write_flat_file
    vectors = (np.load(path, mmap_mode="r") for path in shards)
    _write_flat_file(folder / "streamed.faiss", dim, docs, vectors)
seconds = time.perf_counter() - start
peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print({{"seconds": seconds, "peak_mb": peak_mb}})
"""


def write_shards(folder: Path, docs: int, dim: int, shard_docs: int) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    for shard, start in enumerate(range(0, docs, shard_docs)):
        rows = min(shard_docs, docs - start)
        vectors = rng.standard_normal((rows, dim), dtype=np.float32)
        np.save(folder / f"shard_{shard:05d}.npy", vectors)


def assemble(folder: Path, mode: str, docs: int, dim: int) -> dict:
    code = _CHILD.format(root=str(ROOT), folder=str(folder), mode=mode, docs=docs, dim=dim)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{mode} assembly failed:\n{out.stderr[-3000:]}")
    import ast

    return ast.literal_eval(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--shard_docs", type=int, default=50_000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="flat_assembly_") as tmp:
        folder = Path(tmp)
        t0 = time.perf_counter()
        write_shards(folder, args.docs, args.dim, args.shard_docs)
        print(f"shards: {args.docs:,} x {args.dim} in {time.perf_counter() - t0:.0f} s",
              flush=True)  # fmt: skip
        result = {"docs": args.docs, "dim": args.dim, "shard_docs": args.shard_docs,
                  "index_mb": 4 * args.docs * args.dim / 2**20}  # fmt: skip
        for mode in ("whole", "streamed"):
            result[mode] = assemble(folder, mode, args.docs, args.dim)
            print(f"{mode:>9}: {result[mode]['seconds']:.1f} s, peak resident "
                  f"{result[mode]['peak_mb']:,.0f} MB", flush=True)  # fmt: skip
        result["same_bytes"] = filecmp.cmp(folder / "whole.faiss", folder / "streamed.faiss",
                                           shallow=False)  # fmt: skip
    ratio = result["whole"]["peak_mb"] / result["streamed"]["peak_mb"]
    print(
        f"index {result['index_mb']:,.0f} MB; streamed peak is 1/{ratio:.1f} of whole's; "
        f"same bytes: {result['same_bytes']}"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
