"""The index on GPUs with faiss-gpu: one GPU or sharded over all, the CPU's top-k."""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
faiss = pytest.importorskip("faiss")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    if faiss.get_num_gpus() == 0:
        pytest.skip("faiss sees no GPU (faiss-cpu installed, or no device)")
    from ray_credit.actors.index_build import ensure_index

    docs = [{"id": str(i), "contents": f"title {i}\ntext about {i} and {i * 7 % 13}"}
            for i in range(300)]  # fmt: skip
    return ensure_index(docs, tmp_path_factory.mktemp("idx") / "flat")


@pytest.mark.parametrize("devices,float16", [("0", False), ("all", False), ("all", True)])
def test_a_gpu_index_returns_the_cpu_top_k(folder, devices, float16):
    from ray_credit.actors.dense_index import DenseIndex, IndexConfig

    cpu = DenseIndex.load(folder, IndexConfig(use_gpu=False))
    gpu = DenseIndex.load(folder, IndexConfig(use_gpu=True, gpu_devices=devices,
                                              gpu_float16=float16))  # fmt: skip
    assert gpu.on_gpu and not cpu.on_gpu
    want = list(range(faiss.get_num_gpus())) if devices == "all" else [0]
    assert gpu.gpus == want
    queries = np.random.default_rng(0).standard_normal((64, cpu.manifest["dim"]), np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    cpu_scores, cpu_rows = cpu.search(queries, 5)
    gpu_scores, gpu_rows = gpu.search(queries, 5)
    np.testing.assert_allclose(gpu_scores, cpu_scores, atol=2e-3 if float16 else 1e-4)
    assert (gpu_rows[:, 0] == cpu_rows[:, 0]).mean() > 0.98  # ties may order differently
