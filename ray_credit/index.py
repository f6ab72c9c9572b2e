"""Build a retrieval index folder once, before any run or server needs it.

    python -m ray_credit.index build --corpus wiki-18.jsonl --encoder.name e5-base-v2 \\
        --index.kind flat --out /shared/indexes/wiki18-e5-flat --build.workers 8 \\
        --build.worker_gpus 1
    python -m ray_credit.index build --corpus wiki-18.jsonl --encoder.name e5-base-v2 \\
        --import e5_Flat.index --out /shared/indexes/wiki18-e5-shipped
    python -m ray_credit.index build --help               # every setting

The corpus (.jsonl, .jsonl.gz, .parquet or DPR's .tsv) is converted into the folder as Arrow; the
passages are embedded in shards on disk by a Ray Data pool of --build.workers encoder
actors (0: this process), resumably; IVF and PQ train on --index.train_sample vectors;
the index is written with a manifest. --import takes a faiss index built elsewhere on the
corpus's line order instead, checked against a re-encoded sample. What --out holds already
is taken only when these settings made it (a whole index: nothing to do; a killed build:
resumed); anything else there is refused, or deleted and built anew with --overwrite. Then:
pipelines take
--retriever.index_folder FOLDER, and `python -m ray_credit.serve --index_folder FOLDER`.
With --build.workers >= 1 it connects to the Ray cluster of RAY_ADDRESS, else to one
`ray start` runs on this machine, else starts one.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ray_credit.actors.dense_index import IndexConfig, check_index_config, read_manifest
from ray_credit.actors.encoder import EncoderConfig, encoder_dim
from ray_credit.actors.index_build import BuildConfig
from ray_credit.config import InputError, check_fields, parse_config

__all__ = ["IndexCommand", "main"]

_PROG = "python -m ray_credit.index build"


@dataclass(frozen=True)
class IndexCommand:
    """One index folder: the corpus, the encoder, the index, how to build it."""

    corpus: str = ""
    """The FlashRAG / Search-R1 corpus (.jsonl, .jsonl.gz or .parquet; one {"id",
    "contents"} per document, contents = title line + text), or DPR's .tsv with its header
    row (id, text, title). Required."""
    out: str = ""
    """The index folder to write (new, empty, or a build of the same settings to resume)."""
    overwrite: bool = False
    """Delete what a build wrote in --out (an index, a partial build, its corpus and
    embeddings, of any settings) and build anew; a folder that also holds other files is
    refused, nothing deleted."""
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    """The passage (and later query) encoder."""
    index: IndexConfig = field(default_factory=IndexConfig)
    """The faiss index."""
    index_file: str | None = None
    """A faiss index built elsewhere on the corpus's line order, to import instead of
    building one (also --import FILE)."""
    build: BuildConfig = field(default_factory=BuildConfig)
    """Workers, shards and checks of the build."""

    def __post_init__(self) -> None:
        check_fields(self)


def check_inputs(cmd: IndexCommand) -> bool:
    """Everything that can be refused before Ray starts or a passage is embedded. True:
    --out holds a whole index of these settings already (nothing to do)."""
    from ray_credit.actors.corpus import count_docs
    from ray_credit.actors.dense_index import check_index_folder
    from ray_credit.actors.index_build import check_encoder_name, check_made_by, check_writable

    if not cmd.corpus or not cmd.out:
        raise InputError("--corpus and --out are required: the corpus file and the index folder")
    if cmd.index_file is not None:
        from ray_credit.pipeline.preflight import check_index_part

        check_index_part("--import", cmd.index_file)
    if cmd.index_file is not None and not Path(cmd.index_file).is_file():
        raise InputError(f"--import {cmd.index_file}: no such file")
    check_index_folder(cmd.out)
    if not cmd.overwrite and read_manifest(cmd.out) is not None:
        index_file = cmd.index_file and str(Path(cmd.index_file).absolute())
        check_made_by(cmd.out, cmd.corpus, cmd.encoder, cmd.index, index_file)
        return True
    check_writable(cmd.out)
    check_encoder_name(cmd.encoder)
    num_docs = count_docs(cmd.corpus)
    if num_docs == 0:
        raise InputError(f"--corpus {cmd.corpus} holds no document; an index needs at least one")
    if cmd.index_file is None:
        check_index_config(cmd.index, num_docs, encoder_dim(cmd.encoder))
    return False


def main(argv: Sequence[str] | None = None) -> None:
    """Parse, check, connect Ray when workers are asked for, build, say where it is."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["build"]:
        argv = argv[1:]
    argv = ["--index_file" if a == "--import" else a.replace("--import=", "--index_file=", 1)
            for a in argv]  # fmt: skip
    cmd = parse_config(IndexCommand, argv, description=__doc__)
    try:
        whole = check_inputs(cmd)
    except InputError as err:  # the user's to fix: one line, as argparse's errors
        raise SystemExit(f"{_PROG}: error: {err}") from None
    if whole:
        print(f"{cmd.out} already holds a whole index of these settings; nothing to do",
              flush=True)  # fmt: skip
        return
    if cmd.build.workers:
        import ray

        if not ray.is_initialized():
            ray.init()
        print(f"Ray: {ray.get_runtime_context().gcs_address}", flush=True)
    from ray_credit.actors.index_build import ensure_index

    start = time.perf_counter()
    try:
        folder = ensure_index(cmd.corpus, cmd.out, encoder=cmd.encoder, index=cmd.index,
                              index_file=cmd.index_file, overwrite=cmd.overwrite,
                              **cmd.build.kwargs())  # fmt: skip
    except (InputError, FileNotFoundError) as err:  # the encoder's load failing: one line too
        raise SystemExit(f"{_PROG}: error: {' '.join(str(err).split())}") from None
    manifest = read_manifest(folder)
    print(
        f"index of {manifest['num_docs']} passages ({manifest['index']['kind']}, encoder "
        f"{manifest['encoder']['name']}, dimension {manifest['dim']}) in {folder} "
        f"({time.perf_counter() - start:.0f}s)",
        flush=True,
    )
    print(f"  pipelines: --retriever.index_folder {folder}", flush=True)
    print(f"  a server:  python -m ray_credit.serve --index_folder {folder}", flush=True)


if __name__ == "__main__":
    main()
