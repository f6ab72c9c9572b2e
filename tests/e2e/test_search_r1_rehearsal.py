"""The README's real-data command on Search-R1-shaped files, rehearsed on CPUs: the same
config and placement (8 logical GPUs: four FSDP learner workers, four generators), the
merged parquet, the gzipped corpus and the joined faiss index, a tiny model, one step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.search_r1_files import write_search_r1_files

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
def test_the_search_r1_command_rehearsed_through_step_1(tmp_path):
    files = write_search_r1_files(tmp_path)
    joined = tmp_path / "e5_Flat.index"
    subprocess.run(f"cat {tmp_path}/part_* > {joined}", shell=True, check=True)
    command = [
        sys.executable, str(ROOT / "pipelines" / "tspo.py"),
        "--config", str(ROOT / "pipelines" / "configs" / "search_r1.yaml"),
        "--data.questions", str(files["train"]), "--data.eval_file", str(files["test"]),
        "--data.corpus", str(files["corpus"]), "--retriever.index_file", str(joined),
        # the rehearsal: logical GPUs, every actor on CPUs, a tiny model, one small step
        "--resources.cpu_rehearsal", "true", "--resources.local_gpus", "8",
        "--model", "tiny-random", "--retriever.encoder.name", "minilm",
        "--generator.backend", "transformers", "--generator.dtype", "float32",
        "--learner.autocast", "none", "--learner.gradient_checkpointing", "false",
        "--resources.generator_cpus", "0.25", "--resources.learner_cpus", "0.25",
        "--resources.retriever_cpus", "0.5", "--resources.eval_cpus", "0.25",
        "--generator.group_size", "2", "--generator.max_new_tokens", "8",
        "--pipeline.steps", "1", "--pipeline.groups_per_step", "4",
        "--pipeline.chunk_groups", "2", "--output_dir", str(tmp_path / "runs"),
        "--wandb", "disabled",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local Ray of its own
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-6000:]
    assert "ids repeat across data sources" in log and "bring their own prompt" in log
    assert "note: departs from search-r1: pipeline.max_staleness = 1" in log
    summary = json.loads((tmp_path / "runs" / "search-r1-3b" / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["groups_trained"] == 4
    assert {"eval_before", "eval_after"} <= set(summary)
    before = summary["eval_before"]
    assert before["questions"] == 16  # the test file, whole, by source
    assert before["count_by_source"] == {"nq": 8, "hotpotqa": 8}
    assert "search-r1: pipeline.max_staleness = 1 (search-r1: 0" in "\n".join(summary["departures"])
    metrics = [json.loads(line) for line in
               (tmp_path / "runs" / "search-r1-3b" / "metrics.jsonl").read_text().splitlines()]  # fmt: skip
    assert metrics[0]["gen/generated_tokens"] > 0
