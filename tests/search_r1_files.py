"""Files shaped as Search-R1 ships them, small: its merged NQ + HotpotQA parquet (FlashRAG's
per-source ids, its columns, a prompt per row), its test parquet, a FlashRAG corpus
gzipped as downloaded, and a flat inner-product index made with faiss alone, split into
``part_aa`` and ``part_ab`` as the download is. Used by the unit tests and the rehearsal."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

PROMPT = (
    "Answer the question. Reason inside <think> </think>; search with <search> query "
    "</search> and read the results between <information> </information>; give the "
    "answer inside <answer> </answer>. Question: {question}\n"
)


def _row(source: str, i: int, question: dict, split: str) -> dict:
    text = question["question"]
    golds = list(question["golden_answers"])
    return {
        "id": f"{split}_{i}",  # FlashRAG's ids: each source counts from 0
        "question": text,
        "golden_answers": golds,
        "data_source": source,
        "prompt": [{"role": "user", "content": PROMPT.format(question=text)}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": golds}},
        "extra_info": {"split": split, "index": i},
    }


def write_search_r1_files(folder: Path, *, encoder: str = "minilm") -> dict[str, Path]:
    """``{"train", "test", "corpus", "part_aa", "part_ab", "folder"}`` under ``folder``."""
    import faiss
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ray_credit.actors.encoder import Encoder
    from ray_credit.data import WorldConfig, make_world

    world = make_world(WorldConfig(num_entities=20))
    questions = list(world.questions)
    half = len(questions) // 2
    data = folder / "nq_hotpotqa_train"
    data.mkdir(parents=True)
    train = [_row("nq", i, q, "train") for i, q in enumerate(questions[: half - 8])]
    train += [_row("hotpotqa", i, q, "train") for i, q in enumerate(questions[half:-8])]
    test = [_row("nq", i, q, "test") for i, q in enumerate(questions[half - 8 : half])]
    test += [_row("hotpotqa", i, q, "test") for i, q in enumerate(questions[-8:])]
    paths = {"train": data / "train.parquet", "test": data / "test.parquet"}
    pq.write_table(pa.Table.from_pylist(train), paths["train"])
    pq.write_table(pa.Table.from_pylist(test), paths["test"])
    paths["corpus"] = folder / "wiki-18.jsonl.gz"
    with gzip.open(paths["corpus"], "wt", encoding="utf-8") as out:
        for doc in world.corpus:
            out.write(json.dumps({"id": doc["id"], "contents": doc["contents"]}) + "\n")
    vectors = Encoder(encoder).encode_passages([d["contents"] for d in world.corpus])
    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(vectors.astype("float32"))
    whole = faiss.serialize_index(index).tobytes()
    cut = len(whole) // 2
    for name, part in (("part_aa", whole[:cut]), ("part_ab", whole[cut:])):
        paths[name] = folder / name
        paths[name].write_bytes(part)
    paths["folder"] = folder
    return paths
