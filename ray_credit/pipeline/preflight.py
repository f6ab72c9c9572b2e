"""Checks that run before Ray starts: whatever a user handed us that an actor would
otherwise refuse minutes later, after the warm-start, with a traceback (a model name, the
judge's model, the prompt template, the corpus, the encoder, an index folder, a
checkpoint to resume, demonstrations the warm-start cannot write, a cluster's YAML). Each
refusal is an :class:`~ray_credit.config.InputError` that names the setting and what to do.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ray_credit.storage import StoragePath

__all__ = [
    "check_cluster_config",
    "check_model",
    "check_resume_folder",
    "checked_demonstrations",
    "preflight",
]


def preflight(cfg: Any, train_q: list[dict]) -> None:
    """Refuse, before Ray starts, what would otherwise fail inside an actor minutes later
    (after the warm-start, with a traceback): the model, the judge's model, the prompt
    template, the field steps are stratified by."""
    from ray_credit.config import InputError
    from ray_credit.pipeline.runner import _strata
    from ray_credit.protocol import load_prompt_template

    check_model("model", cfg.model)
    judge = getattr(cfg, "judge", None)
    if judge is not None and judge.backend == "hf" and judge.model:
        check_model("judge.model", judge.model)
    try:
        load_prompt_template(cfg.generator.prompt_template)
    except (OSError, ValueError, TypeError) as err:
        raise InputError(f"generator.prompt_template: {err}") from None
    try:
        _strata(train_q, cfg.pipeline.stratify_by)
    except ValueError as err:
        raise InputError(str(err)) from None
    check_retrieval(cfg)
    check_cluster_config(cfg)


def check_cluster_config(cfg: Any) -> None:
    """``resources.cluster_config``, read and checked before Ray starts: a file that is not
    there or not a cluster launcher YAML is refused, naming the file, the node type and the
    key (:func:`~ray_credit.pipeline.placement.nodes_of_cluster_yaml`). A run that starts a
    local Ray of its own (no RAY_ADDRESS: not submitted to a cluster) places its actors
    on this machine, never on the file's node types, and is refused with it: the user who
    names a cluster's YAML means the run to go to that cluster. The other way round, a run
    that joins a cluster (RAY_ADDRESS) is refused with the local Ray's sizes
    (``resources.local_cpus``, ``local_gpus``), which it never reads."""
    import os
    import sys

    from ray_credit.config import InputError
    from ray_credit.pipeline.placement import nodes_of_cluster_yaml

    res = cfg.resources
    if os.environ.get("RAY_ADDRESS"):  # the cluster's nodes are what they are
        for name in ("local_cpus", "local_gpus"):
            if getattr(res, name) is not None:
                raise InputError(
                    f"resources.{name}={getattr(res, name)} sizes the local Ray a run starts "
                    f"on this machine, and this run joins the cluster at RAY_ADDRESS "
                    f"({os.environ['RAY_ADDRESS']}), whose nodes have what they have; drop "
                    f"--resources.{name} (--resources.cluster_config places the run against "
                    "the cluster's node types)"
                )
    path = res.cluster_config
    if path is None:
        return
    nodes_of_cluster_yaml(path)
    ray = sys.modules.get("ray")  # a Ray this process joined already: the file places on it
    if not os.environ.get("RAY_ADDRESS") and not (ray is not None and ray.is_initialized()):
        raise InputError(
            f"resources.cluster_config {path}: this run is not on a cluster (RAY_ADDRESS is "
            "not set), so it would start a local Ray and place its actors on this machine, "
            "not on the file's node types; submit it to the cluster (`ray job submit "
            "--address http://HEAD:8265 --working-dir . -- python ...`), or drop "
            "--resources.cluster_config"
        )


def check_retrieval(cfg: Any) -> None:
    """The retriever's inputs, before Ray starts: a server's URL answers; else the corpus
    file's first document reads, the encoder is a preset, a model folder or a known hub id,
    and an index folder given holds an index (or nothing yet)."""
    from ray_credit.actors.encoder import ENCODER_PRESETS
    from ray_credit.actors.retriever import check_index_folder, resolve_encoder_path
    from ray_credit.config import InputError
    from ray_credit.data.loaders import iter_corpus

    retriever = cfg.retriever
    if retriever.url:
        from ray_credit.actors.retrieval_server import RemoteRetriever, RetrievalServiceError

        try:  # a wrong URL fails here, not in every generator mid-run
            RemoteRetriever(retriever.url, retries=1).search(["connection check"], 1)
        except (RetrievalServiceError, ValueError) as err:
            raise InputError(f"retriever.url: {err}") from None
        return
    if cfg.data.corpus is not None and cfg.data.questions != "synthetic":
        try:
            first = next(iter_corpus(cfg.data.corpus, batch_size=1, check_duplicates=False), None)
        except InputError as err:
            raise type(err)(f"data.corpus: {err}") from None
        if first is None:
            raise InputError(f"data.corpus {cfg.data.corpus}: the file holds no document")
    try:
        encoder = resolve_encoder_path(retriever.encoder.name)
    except (ImportError, FileNotFoundError) as err:
        raise InputError(f"retriever.encoder.name: {err}") from None
    check_model("retriever.encoder.name", encoder, names=list(ENCODER_PRESETS))
    if retriever.index_folder is not None:
        try:
            check_index_folder(retriever.index_folder)
        except (ValueError, OSError) as err:
            raise InputError(f"retriever.index_folder: {err}") from None


def check_index_settings(cfg: Any, corpus: Any) -> None:
    """Index settings that cannot work for the corpus (nlist above its passage count, a
    PQ m that does not divide the encoder's dimension) and an index file that is not there,
    refused before Ray starts; so is a whole index folder given that the run's encoder and
    index settings did not make."""
    from ray_credit.actors.corpus import count_docs
    from ray_credit.actors.dense_index import check_index_config, read_manifest
    from ray_credit.actors.encoder import encoder_dim
    from ray_credit.config import InputError

    retriever = cfg.retriever
    if retriever.url:
        return
    manifest = read_manifest(retriever.index_folder) if retriever.index_folder else None
    if manifest is not None:
        _check_index_folder_made_by(cfg, corpus, manifest)
        return
    if retriever.index_file is not None:
        check_index_part("retriever.index_file", retriever.index_file)
        if not Path(retriever.index_file).is_file():
            raise InputError(
                f"retriever.index_file {retriever.index_file!r} does not exist (or is not a "
                "file); give the faiss index built on data.corpus (Search-R1's e5_Flat.index)"
            )
        return
    docs = count_docs(corpus)
    try:
        check_index_config(retriever.index, docs, encoder_dim(retriever.encoder))
    except InputError as err:
        raise InputError(f"retriever.index: {err}") from None
    _check_build_in_run(cfg, corpus, docs)


BUILD_IN_RUN_DOCS = 1_000_000
"""Above this many passages, a run does not embed its corpus itself on CPUs."""
CPU_EMBED_RATE = 28.0
"""Passages a second one process embedded on 2 CPU cores (MiniLM, 256 tokens), measured."""


def _check_build_in_run(cfg: Any, corpus: Any, docs: int) -> None:
    """A corpus above :data:`BUILD_IN_RUN_DOCS` passages with no index for it is refused,
    before Ray starts, unless the run's build has GPU workers: the retriever would embed
    every passage on CPUs before training starts, for days, with nothing said."""
    import os

    from ray_credit.actors.dense_index import read_manifest
    from ray_credit.actors.retriever import index_cache_folder
    from ray_credit.config import InputError

    retriever = cfg.retriever
    build = retriever.build
    if docs <= BUILD_IN_RUN_DOCS or (build.workers > 0 and build.worker_gpus > 0):
        return
    folder = retriever.index_folder or index_cache_folder(
        corpus, retriever.encoder, retriever.index
    )
    if read_manifest(folder) is not None:
        return
    days = docs / CPU_EMBED_RATE / 86_400
    name = retriever.encoder.name
    where = os.fspath(corpus) if isinstance(corpus, (str, os.PathLike)) else "the corpus"
    raise InputError(
        f"data.corpus {where} holds {docs:,} passages and no index of them was found "
        f"(in {folder}): the run would embed every passage on CPUs before training starts, "
        f"about {days:.1f} days at the {CPU_EMBED_RATE:.0f} passages/s one process embedded "
        f"on 2 cores with MiniLM ({name} may be slower). Either give an index built "
        f"elsewhere on this corpus (Search-R1's: cat part_aa part_ab > e5_Flat.index, then "
        f"--retriever.index_file e5_Flat.index), or build one once on GPU workers: python "
        f"-m ray_credit.index build --corpus {where} --encoder.name {name} --index.kind "
        f"{retriever.index.kind} --out FOLDER --build.workers 8 --build.worker_gpus 1, then "
        "--retriever.index_folder FOLDER (or give this run --retriever.build.workers N "
        "--retriever.build.worker_gpus 1 to build it on GPUs first)"
    )


def check_index_part(flag: str, index_file: str) -> None:
    """Refuse one part of a faiss index split for download (Search-R1 ships ``part_aa``
    and ``part_ab``), naming the command that joins them."""
    import re

    from ray_credit.config import InputError

    path = Path(index_file)
    if re.fullmatch(r"part_[a-z]{2}", path.name):
        parts = sorted(p.name for p in path.parent.glob("part_??"))
        joined = path.parent / "e5_Flat.index"
        raise InputError(
            f"{flag} {index_file} is one part of a faiss index split for download "
            f"({', '.join(parts) or path.name} in {path.parent}); join the parts into one "
            f"file first, in order: cat {path.parent}/part_* > {joined}, then give {flag} "
            f"{joined}"
        )


def _check_index_folder_made_by(cfg: Any, corpus: Any, manifest: dict) -> None:
    """A whole index folder given to a run is refused, before Ray starts, when the run's
    encoder or index settings are not those it was built with: queries embedded by another
    encoder than the passages' search an index of the same width without an error, and
    retrieve nothing that matters. The corpus is compared here when it is in memory (the
    synthetic world's); a corpus file, by the retriever as it opens the folder."""
    import os

    from ray_credit.actors.index_build import made_by_differences, spell_differences
    from ray_credit.config import InputError

    retriever = cfg.retriever
    folder = retriever.index_folder
    index_file = retriever.index_file and os.path.abspath(retriever.index_file)
    in_memory = None if isinstance(corpus, (str, os.PathLike)) else corpus
    differ = made_by_differences(folder, manifest, in_memory, retriever.encoder,
                                 retriever.index, index_file)  # fmt: skip
    if differ:
        flags = " ".join(
            f"--retriever.{key} {_flag_value(there)}" for key, (there, _) in differ.items()
            if key.startswith(("encoder.", "index."))
        )  # fmt: skip
        raise InputError(
            f"retriever.index_folder {folder} holds an index of other settings "
            f"({spell_differences(differ)}); run with the settings it was built with"
            + (f" ({flags})" if flags else "")
            + ", or give another folder (a new one builds the index there)"
        )


def _flag_value(value: Any) -> str:
    """A setting's value as a flag takes it: ``null``, ``true``, a word, a quoted text."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    text = str(value)
    return text if text and text.split() == [text] else repr(text)


def check_model(setting: str, model: str, *, names: Sequence[str] | None = None) -> None:
    """Refuse a model name no actor could load, before Ray starts: an embedded name, a
    folder with ``config.json`` (a Hugging Face model folder) or an id the hub or its
    cache knows (only its config is fetched). ``names``: the names the setting takes
    besides folders and ids, which the refusal lists (None: the embedded policies)."""
    from ray_credit.config import InputError, InputFileNotFoundError
    from ray_credit.models import EMBEDDED_MODELS, _model_name

    if names is None:
        usage = (
            f"give an embedded name {sorted(EMBEDDED_MODELS)}, a Hugging Face model folder "
            "(with config.json; a run's policy is its checkpoint's learner/model), or a hub id"
        )
    else:
        usage = (
            f"give one of {sorted(names)}, a Hugging Face model folder (with config.json) "
            "or a hub id"
        )
    try:
        name = _model_name(model)  # not a name, blank, or a folder without config.json
    except (TypeError, InputError) as err:
        raise InputError(f"{setting}={model!r}: {err}") from None
    path = Path(name).expanduser()
    if (names is None and name in EMBEDDED_MODELS) or path.is_dir():
        return
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise InputFileNotFoundError(f"{setting}={model!r}: no such folder; {usage}")
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise InputError(
            f"{setting}={model!r} is not a folder here, and the Hugging Face hub (or its "
            f"cache) gave no such model ({reason}); {usage}"
        ) from None


def check_resume_folder(folder: str) -> StoragePath:
    """The checkpoint ``--resume FOLDER`` resumes from (the newest whole one in a run's
    checkpoint folder, or FOLDER itself: :func:`~ray_credit.pipeline.resolve_checkpoint`;
    a path or a URI), refused before Ray starts unless it is whole: the pipeline's state
    (readable JSON) and the learner's part (what :meth:`Pipeline.save` writes)."""
    from ray_credit.config import InputError, InputFileNotFoundError
    from ray_credit.pipeline.checkpointing import LEARNER_DIR, STATE_FILE, resolve_checkpoint

    usage = "pass the checkpoint folder a run wrote (storage_path/name/checkpoint)"
    try:
        path = StoragePath(folder)
        found = path.is_dir()
    except (ValueError, OSError) as err:
        raise InputError(f"--resume {folder}: {err}; {usage}") from None
    if not found:
        raise InputFileNotFoundError(f"--resume {folder}: no such folder; {usage}")
    if (path / "checkpoint").is_dir() and not (path / STATE_FILE).is_file():
        raise InputError(
            f"--resume {folder}: that is a run's folder; its checkpoint is "
            f"{path / 'checkpoint'}: --resume {path / 'checkpoint'}"
        )
    try:
        chosen = resolve_checkpoint(path)
    except FileNotFoundError as err:
        raise InputError(f"--resume {folder}: {err}; {usage}") from None
    where = "" if chosen == path else f" ({chosen.name}, the newest there)"
    if not (chosen / LEARNER_DIR).is_dir():
        raise InputError(
            f"--resume {folder}{where}: not a pipeline checkpoint (it has no learner); {usage}"
        )
    try:
        json.loads((chosen / STATE_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(
            f"--resume {folder}{where}: {STATE_FILE} is damaged ({err}); resume from an "
            "intact checkpoint"
        ) from None
    return chosen


def checked_demonstrations(cfg: Any, corpus: Any, questions: list[dict]) -> dict[str, str]:
    """The titles of the documents the training questions' demonstrations search, by id,
    once every demonstration is known to be writable (refused here, before Ray starts,
    when one is not)."""
    from ray_credit.actors.retriever import Corpus
    from ray_credit.config import InputError
    from ray_credit.warm_start import expert_turns

    if cfg.warm_start.questions > len(questions):
        raise InputError(
            f"warm_start.questions={cfg.warm_start.questions} is more than the "
            f"{len(questions)} training questions; give at most {len(questions)} (0: all)"
        )
    docs = Corpus.coerce(corpus)  # a file: converted once, then mapped
    needed = {str(i) for q in questions for i in q["supporting_doc_ids"] or ()}
    rows = docs.rows_of(needed)  # one scan over the ids; only these titles are read
    titles = {doc["id"]: doc["title"] for doc in docs.hits(list(rows.values()),
                                                            [0.0] * len(rows))}  # fmt: skip
    for q in questions:
        expert_turns(q, titles, cfg.generator)
    return titles
