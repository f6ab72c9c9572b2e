"""Supervised fine-tuning as a Ray Train job (ray_credit.sft): two DDP workers over gloo
give the one-process fine-tuning, and a job started again with the same storage and
name resumes from its checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ray_credit.models import load_model, load_tokenizer
from ray_credit.sft import FitConfig, fine_tune
from ray_credit.warm_start import WarmStartConfig, _finetune, demonstrate
from tests.unit.test_warm_start import GEN, ONE_HOP, TITLES, TWO_HOP, TitleRetriever


@pytest.fixture(scope="module")
def demos():
    tokenizer = load_tokenizer("tiny-random")
    questions = [{**q, "question": f"{q['question']} ({i})"} for i in range(4)
                 for q in (ONE_HOP, TWO_HOP)]  # fmt: skip
    batch, _ = demonstrate(questions, TITLES, tokenizer, TitleRetriever(), GEN)
    return batch, int(tokenizer.pad_token_id)


@pytest.mark.e2e  # a Ray Train job of two workers: the second test command
def test_two_ddp_workers_fit_what_one_process_fits(ray_cluster, demos, tmp_path):
    batch, pad = demos
    ws = WarmStartConfig(enabled=True, epochs=2, lr=3e-3, batch_size=4)
    here, _ = load_model("tiny-random")
    expected = _finetune(here, batch, ws, pad, "cpu")
    fit = FitConfig(epochs=2, lr=3e-3, batch_size=4, workers=2, cpus_per_worker=1)
    got = fine_tune("tiny-random", batch, fit, pad_token_id=pad, storage_path=str(tmp_path),
                    name="ddp", out=tmp_path / "policy")  # fmt: skip
    assert got["optimizer_steps"] == expected["optimizer_steps"] == 4
    assert got["loss_per_epoch"] == pytest.approx(expected["loss_per_epoch"], rel=1e-4)
    trained, _ = load_model(str(tmp_path / "policy"))
    for name, value in here.state_dict().items():
        torch.testing.assert_close(trained.state_dict()[name], value, rtol=1e-4, atol=1e-5)
    assert (tmp_path / "policy" / "tokenizer_config.json").is_file()
    assert not (tmp_path / "policy" / "sft_metrics.json").exists()


def _checkpoints(run: Path) -> list[Path]:
    """A Ray Train run's checkpoint folders (its checkpoint_manager_snapshot.json beside
    them matches the same glob)."""
    return [p for p in run.glob("checkpoint_*") if p.is_dir()]


@pytest.mark.e2e  # two Ray Train jobs, the second resumed: the second test command
def test_a_job_started_again_resumes_from_its_checkpoint(ray_cluster, demos, tmp_path):
    batch, pad = demos
    first = FitConfig(epochs=1, lr=3e-3, batch_size=4)
    one = fine_tune("tiny-random", batch, first, pad_token_id=pad, storage_path=str(tmp_path),
                    name="job", out=tmp_path / "one")  # fmt: skip
    assert one["resumed_epoch"] == 0 and len(one["loss_per_epoch"]) == 1
    checkpoints = _checkpoints(tmp_path / "job")
    assert len(checkpoints) == 1 and (checkpoints[0] / "model.safetensors").is_file()
    progress = json.loads((checkpoints[0] / "progress.json").read_text())
    assert progress["epoch"] == 0
    # the same job asked for 2 epochs: the first is not trained again
    again = fine_tune("tiny-random", batch, FitConfig(epochs=2, lr=3e-3, batch_size=4),
                      pad_token_id=pad, storage_path=str(tmp_path), name="job",
                      out=tmp_path / "two")  # fmt: skip
    assert again["resumed_epoch"] == 1
    assert again["loss_per_epoch"][0] == pytest.approx(one["loss_per_epoch"][0])
    assert len(again["loss_per_epoch"]) == 2


@pytest.mark.e2e  # the script as users run it, two workers: the second test command
def test_pipelines_sft_fits_a_chat_file_on_two_workers(ray_cluster, tmp_path):
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    demos = tmp_path / "demos.jsonl"
    demos.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"What is {i} plus {i}?"},
        {"role": "assistant", "content": f"<answer> {2 * i} </answer>"},
    ]}) + "\n" for i in range(12)))  # fmt: skip
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    out = subprocess.run(
        [sys.executable, str(root / "pipelines" / "sft.py"), "--model", "tiny-random",
         "--data", str(demos), "--out", str(tmp_path / "policy"), "--fit.workers", "2",
         "--fit.batch_size", "4", "--fit.epochs", "2", "--fit.lr", "3e-3"],
        capture_output=True, text=True, env=env, cwd=root, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "policy" / "sft.json").read_text())
    assert summary["demonstrations"] == 12 and summary["optimizer_steps"] == 6
    assert summary["loss_per_epoch"][1] < summary["loss_per_epoch"][0]
    load_model(str(tmp_path / "policy"))  # a model folder any pipeline takes as --model
    saved = _checkpoints(tmp_path / "sft")
    assert saved and (saved[0] / "model.safetensors").is_file()  # next to --out, by default
