import pytest


def pytest_collection_modifyitems(config, items):
    """Skip `gpu`-marked tests where torch sees no CUDA device (the CPU CI machine)."""
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
