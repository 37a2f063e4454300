"""CacheBlend's selection: recompute the copied tokens whose values deviate most.

A copied token's K/V were computed after another context. Layer 0's K/V depend on the
token and its position alone (already right once keys are re-rotated); layer
:data:`~ragkv.cache_engine.chunk_reuse.config.DEVIATION_LAYER` is the first that sees
the context. A probe forward over every token after the prefix (the model runner's,
stopped once that layer has stored its K/V) overwrites those layers with fresh K/V; the
copied tokens whose fresh values differ most from the copied ones are the tokens whose
context mattered, and they are recomputed on every layer by the blended forward. The
probe's fresh K/V stay in place: they are exact, the copies were not.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ragkv.cache_engine.chunk_reuse.config import DEVIATION_LAYER
from ragkv.cache_engine.chunk_reuse.placement import dst_slots
from ragkv.cache_engine.chunk_reuse.planner import BlendPlan


@torch.inference_mode()
def choose_by_deviation(
    plan: BlendPlan,
    block_table: list[int],
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    block_size: int,
    probe: Callable[[int], None],
) -> None:
    """Pick the plan's ``choose`` recomputed tokens by value deviation on the deviation
    layer; ``probe(layer)`` computes fresh K/V of layers ``0..layer`` for every position
    from ``plan.start`` to the prompt's end. Call after the plan's K/V were placed."""
    if not plan.choose:
        return
    layer = min(DEVIATION_LAYER, len(kv_caches) - 1)
    if layer == 0 or plan.choose >= len(plan.dst_positions):  # nothing to choose between
        plan.keep_first_k()
        return
    values = kv_caches[layer][1].flatten(0, 1)  # [slots, kv_heads, head_dim], a view
    slots = torch.tensor(
        dst_slots(plan, block_table, block_size), dtype=torch.long, device=values.device
    )
    before = values.index_select(0, slots).float()  # a copy: the probe overwrites the pool
    probe(layer)
    deviation = (values.index_select(0, slots).float() - before).square().sum((1, 2))
    top = deviation.topk(plan.choose).indices.tolist()
    plan.choose_recomputed([plan.dst_positions[i] for i in top])
