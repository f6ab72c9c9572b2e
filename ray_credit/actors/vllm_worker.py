"""A vLLM worker extension for in-place weight updates (loaded by name inside vLLM workers).

vLLM mixes ``worker_extension_cls`` into each GPU worker; ``LLM.collective_rpc(name,
args)`` then calls the method on every worker. Kept import-light: vLLM imports this module
in its own worker processes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class WeightUpdateExtension:
    """``load_named_weights``: copy a published state dict into the worker's model."""

    def load_named_weights(self, weights: Mapping[str, Any]) -> int:
        import torch

        device = self.device  # set by vLLM's worker
        pairs = [(name, torch.as_tensor(value).to(device)) for name, value in weights.items()]
        self.model_runner.model.load_weights(weights=pairs)
        torch.cuda.synchronize(device)
        return len(pairs)
