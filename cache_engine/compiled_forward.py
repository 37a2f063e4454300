"""The model forward compiled by TorchInductor (opt-in: ``EngineConfig.compile``).

One graph per model, dynamic in the step's token count and in the number of logits rows:
the paged attention is the opaque custom op ``ragkv::paged_attention``
(:mod:`~ragkv.cache_engine.attention`), so nothing in a layer breaks the graph, and the
step's metadata reaches the op through :func:`~ragkv.cache_engine.attention.step_scope`
instead of the graph's inputs. TorchDynamo still specializes a size of 1 (a decode step of
one request, one sampled row), so a step falls into one of three graphs (one token; many
tokens and one row; many of both); :meth:`warm_up` compiles them when the engine starts,
and no request pays for a compilation.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from ragkv.cache_engine.attention import StepContext, step_scope

logger = logging.getLogger(__name__)


class CompiledForward:
    """``model(input_ids, position_ids, logits_to_keep=rows).logits``, compiled once."""

    def __init__(self, model: Any, regional: bool = True) -> None:
        self.model = model
        if regional:
            for layer in model.model.layers:
                layer.compile(dynamic=True, fullgraph=True)
            self._compiled = self._forward
        else:
            self._compiled = torch.compile(self._forward, dynamic=True, fullgraph=True)

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids, position_ids=positions, use_cache=False, logits_to_keep=rows
        )
        return out.logits

    def __call__(
        self,
        step: StepContext,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        with step_scope(step), torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True):
            return self._compiled(input_ids, positions, rows)

    def warm_up(self, run: Any) -> float:
        """Compile every shape a step can take, by calling ``run(num_tokens, num_rows)`` (a
        forward of that shape over scratch KV slots); returns the seconds it took."""
        started = time.perf_counter()
        # Distinct sizes (3 tokens, 2 rows): sizes equal at compile time would be assumed
        # equal ("duck sizing") and a step with other sizes would recompile.
        for num_tokens, num_rows in ((3, 2), (3, 1), (1, 1)):
            run(num_tokens, num_rows)
        took = time.perf_counter() - started
        logger.info("compiled the model forward in %.1f s", took)
        return took
