"""The torch reference of :func:`~ragkv.kernels.paged_attention`: the engine's CPU path, so
it is built for speed as well as exactness.

SDPA per sequence over its K/V, read through the step's
:class:`~ragkv.kernels.attention_plan.AttentionPlan` (built once per step, see
:func:`~ragkv.kernels.attention_plan.plan_attention`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ragkv.errors import InvalidInputError
from ragkv.kernels.attention_plan import AttentionPlan, DecodeBatch, IntSeq, Segment, to_list


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    q_positions: IntSeq | None = None,
) -> torch.Tensor:
    """Torch path of :func:`paged_attention`: SDPA per sequence over its K/V.

    A sequence whose blocks are consecutive in the cache reads them as a zero-copy view;
    otherwise its blocks are gathered with one ``index_select``. Decode sequences that need
    a gather are batched into a single padded, masked SDPA call. Everything that depends
    only on the metadata lives in ``plan`` (see :func:`plan_attention`), query positions
    included: ``q_positions``, when given, is checked against the positions the plan was
    built for (a plan of other positions raises :class:`InvalidInputError`).
    """
    if q_positions is not None and not _plan_is_for(plan, q_positions):
        raise InvalidInputError(
            "the attention plan was built for other q_positions; build it with "
            "plan_attention(..., q_positions) of this step.",
            param="q_positions",
        )
    out = torch.empty_like(q)
    if plan.decode is not None:
        decode_gathered(q, k_cache, v_cache, plan.decode, scale, out)
    for start, end, prefix, tail, mask in plan.seqs:
        k, v = _read(k_cache, tail), _read(v_cache, tail)
        if not prefix:
            out[start:end] = _attend(q[start:end], k, v, scale, mask)
            continue
        qs = q[start:end].transpose(0, 1).unsqueeze(0)
        parts = [_attend_lse(qs, _read(k_cache, r), _read(v_cache, r), scale) for r in prefix]
        # The tail needs a causal mask: additive (``mask``) when it is longer than the query
        # chunk, implicit when exactly as long (and the chunk has more than one query).
        causal = mask is None and end - start > 1
        parts.append(_attend_lse(qs, k, v, scale, mask, causal=causal))
        out[start:end] = _merge(parts)[0].transpose(0, 1)
    return out


def _plan_is_for(plan: AttentionPlan, q_positions: IntSeq) -> bool:
    # The engine hands every layer the plan's own list: identity, no per-layer compare.
    if plan.q_positions is q_positions:
        return True
    return plan.q_positions is not None and plan.q_positions == to_list(q_positions)


def _read(cache: torch.Tensor, segment: Segment) -> torch.Tensor:
    """The ``[tokens, H_kv, D]`` K or V of a segment: a view of a block range, else a gather."""
    blocks, tokens = segment
    picked = cache[blocks] if isinstance(blocks, slice) else cache.index_select(0, blocks)
    return picked.flatten(0, 1)[:tokens]


def _attend_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    *,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[1, H, q_len, D]`` over one key segment: (out ``[1, H, q_len, D]``, logsumexp).

    A prefix segment is fully visible (the default). The caller says when a segment is
    causal: never inferred from lengths, since a prefix run can be exactly as long as the
    query chunk.
    """
    k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, is_causal=causal, attn_mask=mask, scale=scale
    )
    return out, lse


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Softmax over the union of key segments from each segment's (out, logsumexp)."""
    out, lse = parts[0]
    dtype, out = out.dtype, out.float()  # in place below: each out is a fresh SDPA result
    for o, part_lse in parts[1:]:
        total = torch.logaddexp(lse, part_lse)
        out.mul_((lse - total).exp_().unsqueeze(-1))
        out.addcmul_(o, (part_lse - total).exp_().unsqueeze(-1))
        lse = total
    return out.to(dtype)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> torch.Tensor:
    """Bottom-right causal SDPA of q ``[q_len, H, D]`` over k, v ``[kv_len, H_kv, D]``;
    ``mask`` is the additive causal mask when ``0 < q_len < kv_len``, or the position mask
    of queries at explicit positions (any ``q_len``)."""
    q_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads, _ = k.shape
    k = k.transpose(0, 1).unsqueeze(0)
    v = v.transpose(0, 1).unsqueeze(0)
    if q_len == 1 and mask is None:
        # Decode: the query heads sharing a KV head become rows of one [G, D] query, so GQA
        # needs no expansion and no mask (the single query sees every key).
        q = q.view(1, num_kv_heads, num_heads // num_kv_heads, head_dim)
        return F.scaled_dot_product_attention(q, k, v, scale=scale).view(1, num_heads, head_dim)
    q = q.transpose(0, 1).unsqueeze(0)
    gqa = num_heads != num_kv_heads
    causal = mask is None  # q_len == kv_len: top-left and bottom-right causal coincide
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa
    )
    return o[0].transpose(0, 1)


def decode_gathered(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodeBatch,
    scale: float,
    out: torch.Tensor,
) -> None:
    """One padded SDPA call for decode sequences whose blocks must be gathered.

    Unwritten cache memory may hold NaN, which a mask cannot cancel (NaN * 0 = NaN): the
    table's padding is pointed at each sequence's own first block, and gathered slots past
    each sequence's length are zeroed before the masked SDPA.
    """
    _, _, num_kv_heads, head_dim = k_cache.shape
    num_heads, batch = q.shape[1], len(plan.rows)
    k = k_cache.index_select(0, plan.blocks).view(batch, -1, num_kv_heads, head_dim)
    v = v_cache.index_select(0, plan.blocks).view(batch, -1, num_kv_heads, head_dim)
    if plan.past_end is not None:
        k.view(-1, num_kv_heads, head_dim).index_fill_(0, plan.past_end, 0)
        v.view(-1, num_kv_heads, head_dim).index_fill_(0, plan.past_end, 0)
    qg = q[plan.rows].view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    o = F.scaled_dot_product_attention(
        qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=plan.mask, scale=scale
    )
    out[plan.rows] = o.view(batch, num_heads, head_dim)
