"""bench/gpu_check.py as CI runs it: --dry-run builds every check's settings and stops
before the first CUDA call."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"


def test_the_dry_run_sets_up_every_check_without_a_gpu():
    out = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], capture_output=True,
                         text=True, cwd=ROOT, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "8 checks set up, nothing run on a GPU" in out.stdout
    for check in ("transformers", "slices", "vllm", "raw", "learner", "faiss", "pipeline",
                  "scale"):  # fmt: skip
        assert f"  {check}" in out.stdout
    # the pipeline it would run is one a local Ray of one GPU places
    assert "--resources.learner_gpus 0.5 --resources.generator_gpus 0.4" in out.stdout
    assert "cuda" not in out.stderr.lower()


def test_an_unknown_check_is_named():
    out = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--only", "vllm,nope"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)  # fmt: skip
    assert out.returncode == 2 and "unknown checks ['nope']" in out.stderr


def test_the_pipeline_check_places_on_one_gpu():
    """Its learner (half a GPU) and vLLM generator (0.4) share the one GPU; the
    evaluations run on the generator."""
    sys.path.insert(0, str(ROOT / "bench"))
    import argparse

    from gpu_check import settings

    from ray_credit.pipeline.cli import run_config_class
    from ray_credit.pipeline.configs import load_config
    from ray_credit.pipeline.placement import local_nodes, place, run_asks

    args = argparse.Namespace(raw_tokens=128, faiss_docs=1000, slice_rows=1000)
    argv = settings(args)["pipeline"][2:]
    cfg = load_config(run_config_class(ROOT / "pipelines" / "tspo.py", "TSPORun"), "tspo", argv)
    placement = place(run_asks(cfg, set()), local_nodes(cfg.resources, 16), "one GPU")
    assert placement.spots["learner 0"].gpus == ((0, 0.5),)
    assert placement.spots["generator 0"].gpus == ((0, 0.4),)


@pytest.mark.e2e  # two learner updates with a KL reference: the second test command
@pytest.mark.bench
def test_a_scale_case_trains_and_estimates_its_memory_on_a_cpu():
    """The scale check's update, on a process group of one over gloo, with the KL
    reference and LoRA of its largest case, on a two-layer model of that architecture."""
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_check import ARCHITECTURES, SCALE_CASES, scale_batch, scale_case

    from ray_credit.testing import process_group_of_one

    arch, strategy, settings = SCALE_CASES[-1]
    assert settings["kl_coef"] > 0 and settings["lora"]["rank"] > 0
    tiny = dict(ARCHITECTURES[arch], hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=32_000)  # fmt: skip
    with process_group_of_one("gloo"):
        out = scale_case(tiny, strategy, settings, scale_batch(rows_per_group=2, groups=2), "cpu")
    assert out["tokens"] > 0 and out["step_s"] > 0
    assert np.isfinite(out["loss"]) and out["grad_norm"] > 0
    assert 0 < out["estimate_gb"] < 10  # a two-layer model's bf16 weights, adapters, logits
    assert "peak_reserved_gb" not in out  # measured on CUDA only


def test_a_scale_case_frees_its_learner_before_the_next_one():
    """The phase wrappers held the learner's bound methods, a reference cycle: a case's
    weights, AdamW state and KL reference outlived it until the garbage collector ran,
    and on a GPU the next case's peak counted them (the 3B KL case and the LoRA case of
    the H200 record followed a case still held). Each case now frees its learner."""
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_check import ARCHITECTURES, scale_batch, scale_case

    from ray_credit.testing import process_group_of_one

    tiny = dict(ARCHITECTURES["qwen2.5-3b"], hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=32_000)  # fmt: skip
    batch = scale_batch(rows_per_group=2, groups=1)
    with process_group_of_one("gloo"):
        for settings in ({"micro_batch_tokens": 4096}, {"micro_batch_tokens": 4096,
                                                         "kl_coef": 0.001}):  # fmt: skip
            out = scale_case(tiny, "fsdp", settings, batch, "cpu")
            assert out["learner_freed"], settings


def test_phase_peaks_nest_over_a_counter_that_each_phase_resets():
    """_Phases over a stand-in for torch.cuda's counters: the passes' peak includes the
    optimizer step that ran inside them (whose start reset the counter)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from types import SimpleNamespace

    from gpu_check import _Phases

    gb = 1024**3
    state = {"now": 0, "peak": 0}

    def allocate(n):
        state["now"] += n * gb
        state["peak"] = max(state["peak"], state["now"])

    cuda = SimpleNamespace(
        synchronize=lambda: None, memory_allocated=lambda: state["now"],
        max_memory_allocated=lambda: state["peak"], max_memory_reserved=lambda: state["peak"],
        reset_peak_memory_stats=lambda: state.update(peak=state["now"]),
    )  # fmt: skip
    phases = _Phases(SimpleNamespace(cuda=cuda))
    with phases("passes"):
        allocate(10)  # activations
        allocate(-10)
        allocate(2)  # gradients
        with phases("optimizer"):
            allocate(30)  # AdamW's temporaries
            allocate(-30)
    assert phases.record["optimizer"] == {"start_gb": 2, "peak_gb": 32, "reserved_gb": 32,
                                          "end_gb": 2}  # fmt: skip
    assert phases.record["passes"]["peak_gb"] == 32 and phases.record["passes"]["start_gb"] == 0
    with phases("passes"):  # a second call: the maximum of both
        allocate(5)
    assert phases.record["passes"]["end_gb"] == 7 and phases.record["passes"]["peak_gb"] == 32
