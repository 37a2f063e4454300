"""The model forward compiled by TorchInductor (opt-in: ``EngineConfig.compile``).

Each decoder layer is compiled (regional compilation): one graph, dynamic in the step's
token count, that every layer runs with its own weights as inputs, so compile time does
not grow with depth (the whole model as one graph took 384 s to compile on 2 loaded
cores, the layers 20-35 s). The paged attention is the opaque custom op
``ragkv::paged_attention`` (:mod:`~ragkv.cache_engine.attention`), so nothing in a layer
breaks the graph; the step's metadata reaches the op through
:func:`~ragkv.cache_engine.attention.step_scope` instead of the graph's inputs, and the
layer index is an unspecialized int (``allow_unspec_int_on_nn_module``), else each layer
would compile its own graph. TorchDynamo still specializes a size of 1, so there are two
graphs (one token, a decode of one request; more tokens); :meth:`warm_up` compiles both
when the engine starts, and no request pays for a compilation.

Measured with ``benchmarks/forward_cpu.py`` (SmolLM2-135M, 2-core AMD EPYC, one torch
thread, CPU time per forward, 2026-12-02): decode of 1 / 4 requests 74 / 132 ms eager
with BLAS linears, 79 / 146 ms compiled, 51 / 85 ms eager with packed linears (the
default); a prefill of 64 tokens over 512 cached 307 / 319 / 184 ms. Inductor keeps the
BLAS GEMM (its lowering rejects the oneDNN-packed linear), and the rest of a layer
(norms, RoPE, activations) is too small a share for fusion to pay, so on this CPU
compiling loses to the default; it stays opt-in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from ragkv.cache_engine.attention import StepContext, step_scope

logger = logging.getLogger(__name__)


class CompiledForward:
    """``model(input_ids, position_ids, logits_to_keep=rows).logits`` with compiled layers."""

    def __init__(self, model: Any) -> None:
        self.model = model
        for layer in model.model.layers:  # llama, mistral, qwen2, qwen3 (model_support.py)
            layer.compile(dynamic=True, fullgraph=True)

    def __call__(
        self,
        step: StepContext,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        with step_scope(step), torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True):
            out = self.model(
                input_ids=input_ids, position_ids=positions, use_cache=False, logits_to_keep=rows
            )
        return out.logits

    def warm_up(self, run: Callable[[int], object]) -> float:
        """Compile both graphs by calling ``run(num_tokens)`` (a forward of that many tokens
        over scratch KV slots) for 1 and 2 tokens; returns the seconds it took."""
        started = time.perf_counter()
        for num_tokens in (2, 1):
            run(num_tokens)
        took = time.perf_counter() - started
        logger.info("compiled the model forward in %.1f s", took)
        return took
