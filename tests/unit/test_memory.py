"""The memory estimate per GPU printed before Ray starts: Qwen2.5-3B's parameter count
from its config, the parts of a learner worker and a vLLM generator, and the warnings."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ray_credit.pipeline.cli import run_config_class
from ray_credit.pipeline.configs import load_config
from ray_credit.pipeline.memory import GB, estimate, model_shape, report_memory

ROOT = Path(__file__).resolve().parents[2]
QWEN_3B = {  # Qwen2.5-3B-Instruct's config.json, the fields that size it
    "hidden_size": 2048, "intermediate_size": 11008, "num_attention_heads": 16,
    "num_hidden_layers": 36, "num_key_value_heads": 2, "vocab_size": 151936,
    "tie_word_embeddings": True,
}  # fmt: skip


@pytest.fixture
def qwen(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_3B))
    return str(tmp_path)


def _cfg(*argv):
    sys_argv, sys.argv = sys.argv, [str(ROOT / "pipelines" / "tspo.py")]
    try:
        cls = run_config_class(ROOT / "pipelines" / "tspo.py", "TSPORun")
        return load_config(cls, "tspo", list(argv))
    finally:
        sys.argv = sys_argv


def test_the_parameter_count_of_qwen2_5_3b_from_its_config(qwen):
    shape = model_shape(qwen)
    assert round(shape.params / 1e9, 2) == 3.09  # the model card's 3.09B
    assert (shape.layers, shape.kv_heads, shape.head_dim) == (36, 2, 128)
    assert model_shape(str(Path(qwen) / "missing")) is None


def test_search_r1_yaml_fits_80_gb_gpus_part_by_part(qwen):
    cfg = _cfg("--config", str(ROOT / "pipelines/configs/search_r1.yaml"), "--model", qwen)
    learner, generator = estimate(cfg, model_shape(qwen), 80.0)
    p = 3_085_846_528
    # float32 weights, gradients and two AdamW moments, each a quarter under FSDP over 4;
    # the KL loss's frozen reference too
    assert learner["parts"]["weights"] == pytest.approx(p * 4 / 4 / GB)
    assert learner["parts"]["AdamW"] == pytest.approx(2 * p * 4 / 4 / GB)
    assert learner["parts"]["reference"] == pytest.approx(p * 2 / 4 / GB)  # bf16, as verl
    assert learner["total"] < 80
    # vLLM: 0.85 of 80 GB, bf16 weights first, the KV cache the rest (36 layers x 2 KV
    # heads x 128 x 2 (K and V) x 2 bytes = 36,864 bytes per token)
    assert generator["parts"]["weights"] == pytest.approx(p * 2 / GB)
    assert generator["kv_gb"] == pytest.approx(0.85 * 80 - p * 2 / GB - 2.0)
    assert generator["kv_tokens"] == int(generator["kv_gb"] * GB // 36_864)
    # LoRA: only the adapters train, and the base is the reference
    lora = _cfg("--config", str(ROOT / "pipelines/configs/search_r1.yaml"), "--model", qwen,
                "--learner.lora.rank", "64")  # fmt: skip
    row = estimate(lora, model_shape(qwen), 80.0)[0]
    assert "reference" not in row["parts"] and row["parts"]["AdamW"] < 0.5


def test_a_gpu_too_small_is_warned_of_with_what_to_change(qwen, capfd):
    cfg = _cfg("--config", str(ROOT / "pipelines/configs/search_r1.yaml"), "--model", qwen,
               "--resources.gpu_memory_gb", "24", "--resources.learner_workers", "1",
               "--resources.num_generators", "1")  # fmt: skip
    warnings = report_memory(cfg)
    assert any("learner worker (a whole replica, float32) needs about" in w and
               "--learner.lora.rank 64" in w for w in warnings)  # fmt: skip
    assert "3.09B parameters; 24 GB GPUs" in "".join(capfd.readouterr())
    tight = _cfg("--config", str(ROOT / "pipelines/configs/search_r1.yaml"), "--model", qwen,
                 "--resources.gpu_memory_gb", "9",
                 "--generator.vllm.gpu_memory_utilization", "0.8")  # fmt: skip
    assert any("cannot hold one trajectory of 4096 tokens" in w for w in report_memory(tight))
    # a policy whose config is not at hand: said, nothing estimated
    missing = _cfg("--config", str(ROOT / "pipelines/configs/search_r1.yaml"),
                   "--model", "no-such-org/no-such-model")  # fmt: skip
    assert report_memory(missing) == []
    assert "not estimated" in "".join(capfd.readouterr())


def test_search_r1_yaml_on_80_gb_and_aws_yaml_on_a10g_print_no_warning(qwen, capfd):
    """The two configs of the real run, on the GPUs they name: 8 x 80 GB, and the
    A10G's 23,028 MiB (22.49 GiB) on cluster.yaml; both with the KL reference of the
    recipe, in bf16 as verl holds it."""
    for config, gpu_gb in (("search_r1.yaml", "80"), ("aws.yaml", "22.49")):
        cfg = _cfg("--config", str(ROOT / "pipelines" / "configs" / config), "--model", qwen,
                   "--resources.gpu_memory_gb", gpu_gb)  # fmt: skip
        assert cfg.learner.kl_coef == 1e-3 and cfg.learner.reference_dtype == "bfloat16"
        assert report_memory(cfg) == [], config
        learner = estimate(cfg, model_shape(qwen), float(gpu_gb))[0]
        assert learner["parts"]["reference"] > 0 and learner["total"] < float(gpu_gb)
    out = "".join(capfd.readouterr())
    assert "= 62.5 GB of 80" in out and "= 21.2 GB of 22" in out
    # a float32 reference on the A10G would not fit: said, with what to change
    f32 = _cfg("--config", str(ROOT / "pipelines/configs/aws.yaml"), "--model", qwen,
               "--resources.gpu_memory_gb", "22.49", "--learner.reference_dtype", "float32",
               "--learner.micro_batch_tokens", "4096")  # fmt: skip
    assert any("needs about" in w for w in report_memory(f32))


def test_the_learner_estimate_covers_the_peaks_measured_on_a_gpu():
    """The learner updates that bench/gpu_check.py timed on one H200 (its record in
    docs/results): the estimate of each case's settings is at least the peak allocated.
    The cases with a KL reference are left out: that run held the previous case's
    learner on the GPU through them (a reference cycle, since broken:
    test_gpu_check.py::test_a_scale_case_frees_its_learner_before_the_next_one)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_check import ARCHITECTURES, SCALE_CASES, case_name, scale_config, scale_estimate

    record = json.loads((ROOT / "docs" / "results" / "gpu_check_h200.json").read_text())
    measured = record["results"]["scale"]
    checked = 0
    for arch, strategy, settings in SCALE_CASES:
        peak = measured.get(case_name(arch, strategy, settings), {}).get("peak_allocated_gb")
        if peak is None or settings.get("kl_coef"):  # added since, or not measured alone
            continue
        row = scale_estimate(ARCHITECTURES[arch], strategy, scale_config(settings))
        assert row["total"] >= peak, (arch, strategy, settings, row["total"], peak)
        checked += 1
    assert checked == 3


@pytest.mark.e2e  # five learner updates of toy models: the second test command
def test_the_estimates_terms_are_what_the_learner_holds_on_a_cpu():
    """bench/memory_terms.py on toy models: the bytes an update holds per logit, per token
    and layer (per hidden and intermediate unit) and at AdamW's step are at most what the
    estimate counts, and not far below it."""
    sys.path.insert(0, str(ROOT / "bench"))
    from memory_terms import estimator_constants, measure

    measured = measure(turn=512, vocabs=(8000, 12000))
    for term, counted in estimator_constants().items():
        assert 0.6 * counted <= measured[term] <= counted, (term, measured[term], counted)
