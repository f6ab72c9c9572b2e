"""A vLLM worker extension: weight updates in place, and behaviour log-probs as the learner
computes them. vLLM imports this module by name inside its workers
(``LLM(worker_extension_cls=...)``) and :meth:`vllm.LLM.collective_rpc` calls its methods
on every worker. Kept import-light.

**Log-probs.** The learner scores a sampled token with ``log_softmax(logits / T)``, the
tempered distribution before top-k / top-p truncation (what the transformers sampler
records too; see :mod:`ray_credit.actors.sampling`). vLLM returns the raw model's log-probs
(``logprobs_mode="raw_logprobs"``) or those after truncation (``"processed_logprobs"``),
neither of which is that. :meth:`WeightUpdateExtension.use_tempered_logprobs` wraps the
top-k / top-p sampler of vLLM's (V1) model runner so that the log-probs it hands back are
taken from the logits it receives, which vLLM has already divided by the temperature; the
engine must run with ``logprobs_mode="processed_logprobs"`` so that vLLM returns them.
Greedy requests skip that sampler and get ``log_softmax(logits)`` (temperature 1), as in
the transformers sampler.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class WeightUpdateExtension:
    """Methods mixed into each vLLM worker (``self`` is the worker)."""

    def use_tempered_logprobs(self) -> str:
        """Make the sampler return tempered, untruncated log-probs; returns the name of the
        sampling function it wrapped. Raises when the runner has no such sampler (vLLM's
        V2 model runner: run with ``VLLM_USE_V2_MODEL_RUNNER=0``)."""
        import torch

        sampler = getattr(getattr(self.model_runner, "sampler", None), "topk_topp_sampler", None)
        if sampler is None or not callable(getattr(sampler, "forward", None)):
            raise RuntimeError(
                f"{type(self.model_runner).__name__} has no sampler.topk_topp_sampler: "
                "ray_credit needs vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0) to "
                "return the learner's log-probs"
            )
        if getattr(sampler, "_ray_credit_tempered", False):
            return sampler.forward.__name__
        inner = sampler.forward
        sampler.logprobs_mode = "raw_logprobs"  # its own truncated log-probs go unused

        def tempered(logits, generators, k, p):
            # before ``inner``, which may truncate ``logits`` in place
            logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)
            sampled, _ = inner(logits, generators, k, p)
            return sampled, logprobs

        tempered.__name__ = getattr(inner, "__name__", "forward")
        sampler.forward = tempered
        sampler._ray_credit_tempered = True
        return tempered.__name__

    def load_named_weights(self, weights: Mapping[str, Any]) -> int:
        """Load a published state dict (checkpoint names and layout) into the running model
        through vLLM's in-place reload, which redoes the processing that loading a
        checkpoint does (fused projections, CPU kernel layouts); returns tensors loaded."""
        import torch

        pairs = [(name, torch.as_tensor(value)) for name, value in weights.items()]
        self.reload_weights(weights_iterator=iter(pairs), is_checkpoint_format=True)
        device = torch.device(self.device)  # set by vLLM's worker
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return len(pairs)
