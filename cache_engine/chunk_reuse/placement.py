"""Copy reused chunks' K/V to their new positions, keys re-rotated by the position delta.

RoPE rotates each key by an angle linear in its position, so a key computed at position
``p`` becomes the key of position ``p + delta`` by one more rotation of ``delta`` (exact up
to rounding); values carry no position and are copied as they are. Runs in the model
runner before the forward that attends over them, on every layer's paged cache.
"""

from __future__ import annotations

import torch

from ragkv.cache_engine.chunk_reuse.planner import BlendPlan
from ragkv.cache_engine.kv_cache_manager import slot_mapping


def dst_slots(plan: BlendPlan, block_table: list[int], block_size: int) -> list[int]:
    """KV slots of the plan's destination positions in the request's own blocks."""
    slots: list[int] = []
    positions = plan.dst_positions
    i = 0
    while i < len(positions):  # runs of consecutive positions: one slot_mapping call each
        j = i + 1
        while j < len(positions) and positions[j] == positions[j - 1] + 1:
            j += 1
        slots += slot_mapping(block_table, block_size, positions[i], positions[j - 1] + 1)
        i = j
    return slots


@torch.inference_mode()
def place_chunks(
    plan: BlendPlan,
    block_table: list[int],
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    rotate,
    block_size: int,
) -> None:
    """Copy the plan's K/V (every layer) into ``block_table``; ``rotate(keys, delta, old)``
    (:meth:`~ragkv.cache_engine.rope.RopeRotator.rotate`) re-rotates keys from positions ``old``.

    Sources are pinned blocks of other requests (or free, unreferenced ones) and
    destinations are the request's fresh blocks, so no copy reads what another wrote.
    """
    if not plan.dst_positions:
        return
    device = kv_caches[0][0].device
    src = torch.tensor(plan.src_slots, dtype=torch.long, device=device)
    dst = torch.tensor(dst_slots(plan, block_table, block_size), dtype=torch.long, device=device)
    delta = torch.tensor(plan.deltas, dtype=torch.long, device=device)
    old = torch.tensor(plan.dst_positions, dtype=torch.long, device=device) - delta
    for k_cache, v_cache in kv_caches:
        keys = k_cache.flatten(0, 1)  # [slots, kv_heads, head_dim], a view of the pool
        values = v_cache.flatten(0, 1)
        keys.index_copy_(0, dst, rotate(keys.index_select(0, src), delta, old).to(keys.dtype))
        values.index_copy_(0, dst, values.index_select(0, src))
