"""Retrieval at Wikipedia scale, measured on this machine: the corpus's memory and start-up,
the build's embedding rate on 1 and 2 encoder workers, and each index kind's build time,
bytes, queries/s and recall@3 against Flat.

    python bench/retriever_scale.py --docs 1000000 --out bench/results/retriever_scale.json
    python bench/retriever_scale.py --docs 20000 --embed_docs 500      # a quick look

What is measured, in one run:

1. **Corpus.** A corpus of ``--docs`` wiki-sized passages (seeded; a title line and ~95
   words drawn from a Zipf vocabulary, ~600 characters, like wiki-18's 100-word passages)
   is written as jsonl. Each of these runs in a fresh process, which reports the seconds
   and the growth of its resident memory after its imports, private (``rss_anon``: paid by
every process) and file-backed (``rss_file``: mapped pages, shared by a node's processes):
   ``lists``, the loader this library had before (every passage into Python lists, ids
   checked unique, the fingerprint computed); ``convert``, the one-time conversion into
   ``corpus.arrow``; ``open``, :meth:`Corpus.open` of the converted file, then 1,000
   gathers of 3 random hits; ``retriever``, a whole :meth:`Retriever.create` over a
   ``--docs`` Flat index folder (the encoder loaded, the index memory-mapped), and the same
   with ``--index.mmap false`` (the index read into the process).
2. **Build rate.** The first ``--embed_docs`` passages embedded by the index build with
   the embedded MiniLM (256 tokens), in this process (``workers=0``, torch's threads) and
   by a Ray Data pool of 1 and of 2 encoder actors (1 CPU each), start-up included.
3. **Index kinds at ``--docs``.** Embedding a million passages with MiniLM takes this
   2-core machine hours, so the vectors here are synthetic: unit vectors in ``--dim``
   dimensions around ``--clusters`` seeded centers (a mixture, as text embeddings cluster
   by topic), each query a noisy copy of a random passage's vector. Each kind is built by
   the library's own code (shards on disk, IVF/PQ trained on ``--train_sample``, shards
   added in turn), then opened memory-mapped as a retriever opens it; queries go in batches
   of 256, as the coalescing retriever sends them. recall@3: the share of Flat's top 3
   that the kind returns in its top 3, over ``--queries`` queries.

Figures are ratios and rates from one run on one machine; docs/retrieval.md quotes them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def memory_mb() -> dict[str, float]:
    """This process's resident memory: private (``anon``: its own, counted per process)
    and file-backed (``file``: pages of mapped files, shared by every process of the node
    that maps them, and dropped by the kernel under pressure)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) / 1024
    return {"anon": out["RssAnon"] + out.get("RssShmem", 0.0), "file": out["RssFile"]}


def grown(base: dict[str, float]) -> dict[str, float]:
    now = memory_mb()
    return {f"rss_{k}_mb": now[k] - base[k] for k in base}


# ---------------------------------------------------------------------------- corpus
def write_corpus(path: Path, num_docs: int, seed: int) -> None:
    """Seeded wiki-sized passages: a title line and ~95 Zipf-drawn words (~600 chars)."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    vocabulary = ["".join(rng.choice(letters, size=rng.integers(2, 10))) for _ in range(50_000)]
    weights = 1.0 / np.arange(1, len(vocabulary) + 1)
    weights /= weights.sum()
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as out:
        for start in range(0, num_docs, 10_000):
            n = min(10_000, num_docs - start)
            words = rng.choice(len(vocabulary), size=(n, 98), p=weights)
            lengths = rng.integers(85, 98, size=n)
            for i in range(n):
                title = " ".join(vocabulary[w] for w in words[i, :3]).title()
                text = " ".join(vocabulary[w] for w in words[i, 3 : lengths[i]])
                out.write(json.dumps({"id": str(start + i), "contents": f"{title}\n{text}"}))
                out.write("\n")
    tmp.rename(path)


def child(mode: str, path: str, extra: str) -> None:
    """One measurement in a fresh process; prints a JSON line."""
    import random

    if mode == "lists":
        from ray_credit.actors.corpus import corpus_fingerprint
        from ray_credit.data.loaders import iter_corpus

        base, start = memory_mb(), time.perf_counter()
        # as the previous Corpus.from_jsonl: every document as a dict, then the lists
        docs = [doc for chunk in iter_corpus(path, check_duplicates=False) for doc in chunk]
        ids, contents = [], []
        for doc in docs:
            ids.append(str(doc["id"]))
            contents.append(doc["contents"])
        assert len(set(ids)) == len(ids)
        corpus_fingerprint(ids, contents)
        del docs
        out = {"seconds": time.perf_counter() - start, **grown(base)}
    elif mode == "convert":
        from ray_credit.actors.corpus import convert_corpus

        base, start = memory_mb(), time.perf_counter()
        convert_corpus(path, extra)
        out = {"seconds": time.perf_counter() - start, **grown(base)}
    elif mode == "open":
        from ray_credit.actors.corpus import Corpus

        base, start = memory_mb(), time.perf_counter()
        corpus = Corpus.open(path)
        out = {"seconds": time.perf_counter() - start, **grown(base)}
        rng = random.Random(0)
        start = time.perf_counter()
        for _ in range(1000):
            corpus.hits([rng.randrange(len(corpus)) for _ in range(3)], [0.0] * 3)
        out["ms_per_3_hits"] = time.perf_counter() - start  # 1000 gathers: seconds = ms each
        out["after_1000_gathers"] = grown(base)
    elif mode == "retriever":
        import torch  # noqa: F401  (its import is not the retriever's start)

        from ray_credit.actors.dense_index import IndexConfig
        from ray_credit.actors.retriever import Retriever

        base, start = memory_mb(), time.perf_counter()
        retriever = Retriever.create(None, index_folder=path,
                                     index=IndexConfig(mmap=extra == "mmap"))  # fmt: skip
        out = {"seconds": time.perf_counter() - start, **grown(base)}
        retriever.search(["who founded the city"] * 8, topk=3)
        out["after_a_search"] = grown(base)
        out["mmapped"] = retriever.index.mmapped
    else:
        raise SystemExit(f"unknown child mode {mode}")
    print("RESULT " + json.dumps(out), flush=True)


def run_child(mode: str, path: Path, extra: str = "") -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", mode, str(path), extra],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"child {mode} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][7:])


# ---------------------------------------------------------------------------- vectors
class VectorModel:
    """Seeded synthetic passage vectors and queries near them.

    ``latent_dim`` 0: ``clusters`` centers in ``dim`` dimensions, each passage a center
    plus isotropic noise of norm about ``noise`` (the hardest case for any approximate
    index: below the cluster level nothing is structured, so a passage's 2nd and 3rd
    neighbours are near-ties among its cluster). ``latent_dim`` k > 0: the same mixture
    drawn in k dimensions, then mapped into ``dim`` by one fixed random linear map, plus
    isotropic noise of norm 0.05 (text embeddings are thought to lie near a manifold of
    far fewer dimensions than they have). A query is a passage's latent point plus noise
    of half the passage's, mapped the same way."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.dim, self.k, self.noise = args.dim, args.latent_dim, args.noise
        rng = np.random.default_rng(args.seed)
        space = self.k or self.dim
        self.centers = rng.standard_normal((args.clusters, space)).astype(np.float32)
        self.centers /= np.linalg.norm(self.centers, axis=1, keepdims=True)
        self.map = (rng.standard_normal((space, self.dim)).astype(np.float32) / np.sqrt(space)
                    if self.k else None)  # fmt: skip
        self.tag = f"lowrank{self.k}" if self.k else f"iso{self.noise:g}"

    def latent(self, rng, rows: int, noise: float) -> np.ndarray:
        space = self.k or self.dim
        points = self.centers[rng.integers(0, len(self.centers), rows)]
        return points + noise * rng.standard_normal((rows, space), dtype=np.float32) / np.sqrt(
            space)  # fmt: skip

    def embed(self, rng, latent: np.ndarray) -> np.ndarray:
        out = latent if self.map is None else latent @ self.map + 0.05 * rng.standard_normal(
            (len(latent), self.dim), dtype=np.float32) / np.sqrt(self.dim)  # fmt: skip
        return out / np.linalg.norm(out, axis=1, keepdims=True)


def synthetic_vectors(model: VectorModel, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The passages' vectors and their latent points (queries are drawn near these)."""
    rng = np.random.default_rng(seed + 7)
    space = model.k or model.dim
    out = np.empty((n, model.dim), dtype=np.float32)
    latent = np.empty((n, space), dtype=np.float32)
    for start in range(0, n, 100_000):
        m = min(100_000, n - start)
        latent[start : start + m] = model.latent(rng, m, model.noise)
        out[start : start + m] = model.embed(rng, latent[start : start + m])
    return out, latent


def link_corpus(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("corpus.arrow", "corpus.json"):
        if not (dst / name).exists():
            os.link(src / name, dst / name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=1_000_000)
    parser.add_argument("--embed_docs", type=int, default=2000)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--clusters", type=int, default=20_000)
    parser.add_argument("--noise", type=float, default=2.0)
    parser.add_argument("--latent_dim", type=int, default=0, help="0: isotropic noise")
    parser.add_argument("--kinds", default="flat,hnsw,ivfflat,ivfpq")
    parser.add_argument("--nlist", type=int, default=2048)
    parser.add_argument("--nprobe", type=int, default=32)
    parser.add_argument("--pq_m", type=int, default=48)
    parser.add_argument("--hnsw_m", type=int, default=32)
    parser.add_argument("--ef_construction", type=int, default=200)
    parser.add_argument("--ef_search", type=int, default=128)
    parser.add_argument("--train_sample", type=int, default=100_000)
    parser.add_argument("--shard_docs", type=int, default=50_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ray_credit_retriever_scale"))
    parser.add_argument("--skip", default="", help="comma list of sections to skip: "
                        "corpus,build,kinds")  # fmt: skip
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return 0

    import faiss

    from ray_credit.actors import index_build
    from ray_credit.actors.corpus import Corpus, convert_corpus
    from ray_credit.actors.dense_index import DenseIndex, IndexConfig
    from ray_credit.actors.encoder import Encoder, EncoderConfig

    skip = set(filter(None, args.skip.split(",")))
    work = args.workdir / f"{args.docs}docs"
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": f"{platform.node()}: {os.cpu_count()} CPUs, {platform.platform()}",
        "faiss": faiss.__version__,
        "docs": args.docs,
    }
    corpus_path = work / "corpus.jsonl"
    if not corpus_path.exists():
        start = time.perf_counter()
        write_corpus(corpus_path, args.docs, args.seed)
        print(f"wrote {corpus_path} in {time.perf_counter() - start:.0f}s", flush=True)
    report["corpus_bytes"] = corpus_path.stat().st_size
    converted = work / "converted"
    if not (converted / "corpus.json").exists():
        convert_corpus(corpus_path, converted)
    corpus = Corpus.open(converted)

    # 3 first: section 1's retriever start opens the flat index built here
    if "kinds" not in skip:
        report["kinds"] = kinds_section(args, work, converted, corpus, index_build, DenseIndex,
                                        IndexConfig, Encoder)  # fmt: skip
    if "corpus" not in skip:
        shutil.rmtree(work / "convert_once", ignore_errors=True)
        lists = run_child("lists", corpus_path)
        convert = run_child("convert", corpus_path, str(work / "convert_once"))
        opened = run_child("open", work / "convert_once")
        section = {"lists": lists, "convert": convert, "open": opened}
        flat = next(iter(sorted(work.glob("kind_flat_*"))), work / "none")
        if (flat / "manifest.json").exists():
            section["retriever_mmap"] = run_child("retriever", flat, "mmap")
            section["retriever_read"] = run_child("retriever", flat, "read")
        section["open_over_lists_rss_anon"] = opened["rss_anon_mb"] / lists["rss_anon_mb"]
        report["corpus"] = section
        print(json.dumps(section, indent=1), flush=True)
    if "build" not in skip:
        report["build"] = build_section(args, work, corpus_path, index_build, Corpus,
                                        EncoderConfig)  # fmt: skip
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


def build_section(args, work, corpus_path, index_build, Corpus, EncoderConfig) -> dict:
    import ray

    subset = work / f"subset{args.embed_docs}.jsonl"
    with corpus_path.open() as src, subset.open("w") as dst:
        for _, line in zip(range(args.embed_docs), src, strict=False):
            dst.write(line)
    base = work / f"subset{args.embed_docs}"
    shutil.rmtree(base, ignore_errors=True)
    from ray_credit.actors.corpus import convert_corpus

    convert_corpus(subset, base)
    docs = Corpus.open(base)
    encoder = EncoderConfig(name="minilm", device="cpu")
    shard = max(1, args.embed_docs // 8)
    out, vectors = {}, {}
    for workers in (0, 1, 2):
        folder = work / f"embed_w{workers}"
        shutil.rmtree(folder, ignore_errors=True)
        link_corpus(base, folder)
        if workers and not ray.is_initialized():
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        start = time.perf_counter()
        index_build._embed(folder, docs, encoder, shard, workers, 1.0, 0.0, None)
        seconds = time.perf_counter() - start
        out[f"workers_{workers}"] = {"seconds": seconds, "docs_per_s": len(docs) / seconds}
        vectors[workers] = np.concatenate([np.load(p) for p in sorted(
            (folder / "embeddings").glob("shard_*.npy"))])  # fmt: skip
        print(f"embedding {len(docs)} passages, workers={workers}: {seconds:.1f}s", flush=True)
    out["max_abs_diff_vs_in_process"] = float(max(np.abs(vectors[w] - vectors[0]).max()
                                                  for w in (1, 2)))  # fmt: skip
    out["two_over_one_workers"] = out["workers_2"]["docs_per_s"] / out["workers_1"]["docs_per_s"]
    if ray.is_initialized():
        ray.shutdown()
    return out


def kinds_section(args, work, converted, corpus, index_build, DenseIndex, IndexConfig,
                  Encoder) -> dict:  # fmt: skip
    model = VectorModel(args)
    vec_folder = work / f"vectors_{model.tag}"
    n, dim, shard_docs = len(corpus), args.dim, args.shard_docs
    shards = index_build._shards(n, shard_docs)
    rng = np.random.default_rng(args.seed + 1)
    rows = rng.choice(n, args.queries, replace=False)
    latent_path = vec_folder / "query_latent.npy"
    if not latent_path.exists():
        (vec_folder / "embeddings").mkdir(parents=True, exist_ok=True)
        vectors, latent = synthetic_vectors(model, n, args.seed)
        for shard, start, stop in shards:
            np.save(index_build._shard_path(vec_folder, shard), vectors[start:stop])
        np.save(latent_path, latent[rows])
        del vectors, latent
    space = model.k or dim
    near = np.load(latent_path) + 0.5 * args.noise * rng.standard_normal(
        (len(rows), space), dtype=np.float32) / np.sqrt(space)  # fmt: skip
    queries = model.embed(rng, near)
    encoder = Encoder("minilm")  # its manifest: a retriever can open the flat folder
    manifest_base = {"corpus_fingerprint": corpus.fingerprint, "num_docs": n, "dim": dim,
                     "encoder": {**encoder.manifest(), "dim": dim}}  # fmt: skip
    configs = {
        "flat": IndexConfig(),
        "hnsw": IndexConfig(kind="hnsw", hnsw_m=args.hnsw_m, ef_construction=args.ef_construction,
                            ef_search=args.ef_search),
        "ivfflat": IndexConfig(kind="ivfflat", nlist=args.nlist, nprobe=args.nprobe,
                               train_sample=args.train_sample),
        "ivfpq": IndexConfig(kind="ivfpq", nlist=args.nlist, nprobe=args.nprobe,
                             pq_m=args.pq_m, train_sample=args.train_sample),
    }  # fmt: skip
    results, truth = {}, None
    for kind in args.kinds.split(","):
        config = configs[kind]
        folder = work / f"kind_{kind}_{model.tag}"
        if not (folder / "manifest.json").exists():
            shutil.rmtree(folder, ignore_errors=True)
            link_corpus(converted, folder)
            (folder / "embeddings").symlink_to(vec_folder / "embeddings")
            start = time.perf_counter()
            index_build._index_shards(folder, n, dim, config, shard_docs)
            build_s = time.perf_counter() - start
            (folder / "embeddings").unlink()
            manifest = {"format_version": 3, **manifest_base, "index": config.manifest(),
                        "faiss_version": "", "built": {"seconds": build_s}}  # fmt: skip
            (folder / "manifest.json").write_text(json.dumps(manifest))
        build_s = json.loads((folder / "manifest.json").read_text())["built"]["seconds"]
        index = DenseIndex.load(folder)
        index.search(queries[:64], 3)  # warm: the pages of a mapped index come in
        start = time.perf_counter()
        found = np.concatenate([index.search(queries[i : i + 256], 3)[1]
                                for i in range(0, len(queries), 256)])  # fmt: skip
        seconds = time.perf_counter() - start
        if truth is None and kind == "flat":
            truth = found
        recall = None if truth is None else float(np.mean(
            [len(set(a) & set(b)) / 3 for a, b in zip(found, truth, strict=True)]))  # fmt: skip
        results[kind] = {
            "build_s": build_s,
            "index_bytes": (folder / "index.faiss").stat().st_size,
            "bytes_per_passage": (folder / "index.faiss").stat().st_size / n,
            "queries_per_s": len(queries) / seconds,
            "recall_at_3_vs_flat": recall,
            "mmapped": index.mmapped,
            "settings": config.manifest(),
        }
        print(kind, json.dumps(results[kind]), flush=True)
        del index
    return {"vectors": model.tag, "latent_dim": model.k, "noise": model.noise,
            "clusters": args.clusters, "kinds": results}  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
