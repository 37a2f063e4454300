"""Linear layers on CPU through oneDNN with weights packed once (``EngineConfig.prepack_linear``).

On CPU the model forward is mostly its linear layers (63 % of a step, issue 31), and eager
``nn.Linear`` calls the BLAS GEMM, which repacks the weight on every call. oneDNN's inner
product over a weight reordered once into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, the packing TorchInductor's freezing pass
uses) skips that. Measured on a 2-core AMD EPYC (AVX-512), fp32, one thread, SmolLM2-135M's
shapes, ``F.linear`` → packed: ``[4, 576] x [576, 1536]`` 171 → 72 us, ``[64, 576] x
[576, 1536]`` 1,404 → 689 us, the LM head ``[64, 576] x [576, 49152]`` 75 → 21 ms; one row
(a decode of one request) costs about the same either way.

Results are fp32 GEMMs in another summation order: within 1e-4 of the eager forward on the
exactness tests' logits, greedy tokens identical. The packed copy sits next to the original
weight, which stays the module's parameter (tied embeddings, checkpoint fingerprints and
the RoPE re-rotation read the model as loaded), so the weights take twice the memory.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether packed linears apply: fp32 on CPU, with oneDNN built into torch."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class PackedLinear:
    """The forward of one ``nn.Linear`` over its weight packed for oneDNN."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        with torch.no_grad():
            # batch size None: one packing for every number of rows a step has.
            self.weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # oneDNN takes row-major input only (a transposed view is rejected).
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self.weight, self.bias, "none", [], ""
        )


def prepack_linears(model: Any) -> int:
    """Route every ``nn.Linear`` of ``model`` through :class:`PackedLinear`; returns how many.

    The module's own ``forward`` is replaced on the instance, so the model's structure,
    parameters and ``state_dict`` are unchanged.
    """
    count = 0
    for module in model.modules():
        if (
            type(module) is torch.nn.Linear
            and module.weight.dtype == torch.float32
            and module.weight.device.type == "cpu"
        ):
            module.forward = PackedLinear(module)  # type: ignore[method-assign,assignment]
            count += 1
    logger.info("packed %d linear layers for oneDNN", count)
    return count
