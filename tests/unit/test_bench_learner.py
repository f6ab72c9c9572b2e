"""bench/learner.py --micro-batch-memory: each micro-batch size measured in a process of
its own (a peak is per process), its peak and update time reported with the ratios to the
first value, and written beside --out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e  # two training processes of the bench script: the second test command
@pytest.mark.bench
def test_micro_batch_memory_measures_each_value_in_its_own_process(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "learner.py"), "--model", "tiny-random",
         "--questions", "2", "--group_size", "2", "--repeats", "1",
         "--micro-batch-memory", "512,128", "--out", str(tmp_path / "learner.json")],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "learner_memory.json").read_text())
    first, second = report["memory"]
    assert [first["micro_batch_tokens"], second["micro_batch_tokens"]] == [512, 128]
    for r in (first, second):
        assert 0 < r["loaded_gb"] <= r["peak_gb"] and r["seconds"] > 0
    assert first["peak_ratio"] == 1.0 and first["time_ratio"] == 1.0
    assert second["peak_ratio"] == second["peak_gb"] / first["peak_gb"]
    assert "micro_batch_tokens    128: peak" in out.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_peak_is_each_updates_own_though_the_learner_starts_a_new_window(monkeypatch):
    # The learner reads the process's peak at the end of every update and resets it (its
    # memory/learner_peak_gb): the process's VmHWM read after the updates misses them.
    import numpy as np

    import ray_credit.actors.learner as learner_module
    import ray_credit.models as models
    from ray_credit.process_memory import PeakMeter, memory_report

    sys.path.insert(0, str(ROOT / "bench"))
    from learner import peak_memory

    class Updating:  # an update that holds 400 MiB for a moment, as the real one's passes
        def __init__(self, model, config):
            self.meter = PeakMeter()

        def train(self, batch):
            block = np.ones(400 * 2**20 // 8)
            del block
            return {"memory/learner_peak_gb": memory_report(self.meter)["peak_gb"]}

    monkeypatch.setattr(learner_module, "Learner", Updating)
    monkeypatch.setattr(models, "load_model", lambda name: None)
    r = peak_memory("any", batch=None, micro_batch_tokens=1024, repeats=1)
    assert r["peak_gb"] >= r["loaded_gb"] + 0.35
    assert r["after_update_gb"] < r["loaded_gb"] + 0.1  # the block was given back


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_phase_peaks_put_each_spike_in_its_own_phase():
    # Each phase of a stand-in update holds a block of its own size for a moment: the
    # kernel's peak, reset at each boundary, must put each block in its phase alone.
    import numpy as np
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from learner import PHASES, phase_peaks

    from ray_credit.process_memory import PeakMeter, memory_report

    def hold(mib: int) -> None:
        block = np.ones(mib * 2**20 // 8)
        del block

    class Updating:
        meter = PeakMeter()

        def _logits(self):
            hold(200)

        def _clip_and_step(self):
            hold(600)

        def train(self, batch):
            self._logits()
            loss = torch.ones(1, requires_grad=True).sum()
            torch.Tensor.backward(loss)
            hold(400)  # after the backward: the rest
            self._clip_and_step()
            return memory_report(self.meter)

    backward = torch.Tensor.backward
    peaks, _ = phase_peaks(Updating(), batch=None)
    assert torch.Tensor.backward is backward  # put back
    assert list(peaks) == list(PHASES)
    base = min(peaks.values())
    assert peaks["optimizer step"] >= base + 0.5
    assert 0.3 <= peaks["rest"] - base < peaks["optimizer step"] - base
    assert 0.15 <= peaks["forward"] - base < peaks["rest"] - base
