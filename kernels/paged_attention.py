"""paged_attention: causal varlen attention over K/V held in a paged block cache.

One call covers a batch that mixes prefill-with-cached-prefix and decode. For sequence ``i``
its ``q_len = cu_seqlens_q[i+1] - cu_seqlens_q[i]`` query tokens are the *last* tokens of a
sequence of ``seq_lens[i]`` tokens whose K/V (cached prefix and the new tokens, already
stored) live in the blocks ``block_table[i]``::

    keys     0 .............................. context-1 | context ... seq_len-1
    queries                                              | 0 ........... q_len-1
    query t sees keys 0 .. context + t  (bottom-right causal, context = seq_len - q_len)

With ``q_positions`` (one absolute position per query row of the step, in row order) the
query rows of a sequence may instead sit anywhere in it, in any order: the row at position
``p`` sees exactly keys ``0 .. p`` (causal by position; ``0 <= p < seq_len``). A caller
that recomputes a scattered subset of a sequence's tokens over K/V placed there beforehand
uses it. Without it, the code path is the one above, untouched.

Triton kernel and torch reference side by side; :func:`paged_attention` dispatches. The
torch path works from an :class:`AttentionPlan` of the step's metadata: a caller that runs
many layers over one step (the engine's model runner) builds it once with
:func:`plan_attention` and passes it to every layer.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ragkv.errors import InvalidInputError
from ragkv.kernels.dispatch import Backend, check_cache, next_power_of_2, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the torch reference needs no triton
    triton = None

IntSeq = torch.Tensor | Sequence[int]
_MAX_RUNS = 8  # per prefill; more runs are gathered (see _split)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: IntSeq,
    seq_lens: IntSeq,
    scale: float,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    backend: Backend = "auto",
    plan: AttentionPlan | None = None,
    q_positions: IntSeq | None = None,
) -> torch.Tensor:
    """Attention of ``q`` ``[num_tokens, num_heads, head_dim]`` over the paged K/V; returns
    ``[num_tokens, num_heads, head_dim]`` in ``q.dtype`` (fp32 accumulation).

    ``k_cache``/``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``, with
    ``num_heads`` a multiple of ``num_kv_heads`` (MHA, GQA, MQA). ``block_table``: integer
    ``[num_seqs, max_blocks_per_seq]``, padded past each sequence's blocks (never read).
    ``cu_seqlens_q`` ``[num_seqs + 1]`` and ``seq_lens`` ``[num_seqs]`` may be int tensors or,
    for the torch path, host-side Python lists (which saves a ``.tolist()`` per call).
    ``max_seqlen_q`` spares the Triton path a host sync; ``max_seqlen_k`` is accepted for
    API symmetry (the kernel reads each length on the device). ``backend``: "auto"
    (Triton on CUDA, torch otherwise), "triton" or "torch". ``plan``: the torch path's
    :func:`plan_attention` of exactly this metadata (built here when not given).
    ``q_positions``: ``[num_tokens]`` absolute position of each query row (see the module
    docstring); a host list or an int tensor (int32 on the device for Triton). ``None``: the
    rows of each sequence are its last ``q_len`` positions.
    """
    check_cache(k_cache, v_cache)
    if q.dim() != 3 or q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise InvalidInputError(
            f"q must be [num_tokens, num_heads, {k_cache.shape[3]}] with num_heads a multiple "
            f"of num_kv_heads={k_cache.shape[2]}; got {tuple(q.shape)}."
        )
    if block_table.dim() != 2 or len(seq_lens) != block_table.shape[0]:
        raise InvalidInputError(
            f"block_table must be [num_seqs, max_blocks] with num_seqs == len(seq_lens) "
            f"({len(seq_lens)}); got {tuple(block_table.shape)}."
        )
    if len(cu_seqlens_q) != len(seq_lens) + 1:
        raise InvalidInputError("cu_seqlens_q must have len(seq_lens) + 1 entries.")
    if q_positions is not None and len(q_positions) != q.shape[0]:
        raise InvalidInputError(
            f"q_positions must have one entry per query row ({q.shape[0]}); "
            f"got {len(q_positions)}.",
            param="q_positions",
        )
    if use_triton(backend, q):
        return paged_attention_triton(
            q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale, max_seqlen_q,
            q_positions,
        )  # fmt: skip
    if plan is None:
        plan = plan_attention(
            block_table, cu_seqlens_q, seq_lens, k_cache.shape[1], q.dtype, q_positions
        )
    return paged_attention_torch(q, k_cache, v_cache, plan, scale, q_positions)


# ---------------------------------------------------------------------------------------
# torch reference: the engine's CPU path, so it is built for speed as well as exactness.


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
        _decode_gathered(q, k_cache, v_cache, plan.decode, scale, out)
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
    return plan.q_positions is not None and plan.q_positions == _to_list(q_positions)


Segment = tuple[slice | torch.Tensor, int]  # blocks (a range, or ids to gather), tokens used


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


@dataclass(slots=True)
class _DecodeBatch:
    """Index tensors of one padded decode gather (see :func:`_decode_gathered`)."""

    rows: torch.Tensor  # [batch] query rows of the decode sequences
    blocks: torch.Tensor  # [batch * max_blocks] block ids, padding -> the row's first block
    past_end: torch.Tensor | None  # flat gathered token slots past each sequence's length
    mask: torch.Tensor | None  # additive [batch, 1, 1, max_blocks * block_size]


@dataclass(slots=True)
class AttentionPlan:
    """What one step's metadata implies for the torch path, identical for every layer.

    Building it (run detection, index tensors, causal masks) costs more than a layer's
    gathers, and a ``[q_len, kv_len]`` mask rebuilt per layer more than the SDPA it serves,
    so a step builds one plan and hands it to all its layers. It describes the table it was
    built from: a table edited afterwards needs a new plan.
    """

    # Per sequence not in ``decode``: (q start, q end, prefix, tail, mask of the tail or None).
    seqs: list[tuple[int, int, list[Segment], Segment, torch.Tensor | None]]
    decode: _DecodeBatch | None
    q_positions: list[int] | None = None  # the explicit query positions it was built for


def plan_attention(
    block_table: torch.Tensor,
    cu_seqlens_q: IntSeq,
    seq_lens: IntSeq,
    block_size: int,
    dtype: torch.dtype,
    q_positions: IntSeq | None = None,
) -> AttentionPlan:
    """The torch path's plan for one step's metadata (arguments as :func:`paged_attention`'s;
    ``dtype`` is the query's).

    With ``q_positions``, a sequence whose rows are exactly its last ``q_len`` positions in
    order is planned as without them (same segments, same results); any other sequence gets
    a position mask over its keys ``0 .. max(position)`` (see :func:`_plan_positioned`).
    """
    cu, lens = _to_list(cu_seqlens_q), _to_list(seq_lens)
    positions: list[int] | None = None
    positioned: set[int] = set()
    if q_positions is not None:
        positions = q_positions if isinstance(q_positions, list) else _to_list(q_positions)
        positioned = _positioned_seqs(positions, cu, lens)
    device = block_table.device
    n_blocks = [-(-length // block_size) for length in lens]
    first_block, consecutive = _consecutive_runs(block_table, n_blocks)
    gathered_decode = [
        i
        for i in range(len(lens))
        if cu[i + 1] - cu[i] == 1 and not consecutive[i] and i not in positioned
    ]
    decode = None
    if len(gathered_decode) > 1:
        decode = _plan_decode(block_table, cu, lens, n_blocks, gathered_decode, block_size, dtype)
    batched = set(gathered_decode) if decode is not None else set()
    masks: dict[tuple[int, int], torch.Tensor] = {}
    seqs: list[tuple[int, int, list[Segment], Segment, torch.Tensor | None]] = []
    prefix: list[Segment]
    tail: Segment
    mask: torch.Tensor | None
    for i, seq_len in enumerate(lens):
        start, end = cu[i], cu[i + 1]
        if i in batched or start == end:
            continue
        if i in positioned:
            assert positions is not None  # only q_positions makes a sequence positioned
            rows = positions[start:end]
            seqs.append((start, end, *_plan_positioned(block_table[i], rows, block_size, dtype)))
            continue
        q_len, prefix = end - start, []
        if consecutive[i]:
            tail = (slice(first_block[i], first_block[i] + n_blocks[i]), seq_len)
        else:
            prefix, tail = _split(
                block_table[i, : n_blocks[i]], seq_len, seq_len - q_len, block_size
            )
        tail_len, mask = tail[1], None
        if 1 < q_len < tail_len:
            if (q_len, tail_len) not in masks:
                visible = torch.ones(q_len, tail_len, dtype=torch.bool, device=device)
                masks[q_len, tail_len] = _additive(visible.tril(tail_len - q_len), dtype)
            mask = masks[q_len, tail_len]
        seqs.append((start, end, prefix, tail, mask))
    return AttentionPlan(seqs, decode, positions)


def _positioned_seqs(positions: list[int], cu: list[int], lens: list[int]) -> set[int]:
    """The sequences whose query rows are not their last ``q_len`` positions in order.

    Raises :class:`InvalidInputError` for a position outside ``[0, seq_len)``.
    """
    if len(positions) != cu[-1]:
        raise InvalidInputError(
            f"q_positions must have one entry per query row ({cu[-1]}); got {len(positions)}.",
            param="q_positions",
        )
    positioned = set()
    for i, seq_len in enumerate(lens):
        rows = positions[cu[i] : cu[i + 1]]
        if not rows:
            continue
        if min(rows) < 0 or max(rows) >= seq_len:
            raise InvalidInputError(
                f"q_positions of sequence {i} must lie in [0, {seq_len}); "
                f"got {min(rows)} .. {max(rows)}.",
                param="q_positions",
            )
        if rows != list(range(seq_len - len(rows), seq_len)):
            positioned.add(i)
    return positioned


def _plan_positioned(
    table_row: torch.Tensor, rows: list[int], block_size: int, dtype: torch.dtype
) -> tuple[list[Segment], Segment, torch.Tensor]:
    """Prefix, tail and position mask of a sequence whose queries sit at ``rows``.

    Keys past the last position are seen by no row and are not read. Keys before the first
    position are seen by every row: they form the unmasked prefix of runs, as in
    :func:`_split`, and the tail starts at a run that holds key ``min(rows)``, which every
    row sees, so no row of the masked tail is empty.
    """
    kv_len = max(rows) + 1
    blocks = table_row[: -(-kv_len // block_size)]
    prefix, tail = _split(blocks, kv_len, min(rows), block_size)
    tail_start = kv_len - tail[1]
    keys = torch.arange(tail_start, kv_len, device=table_row.device)
    query = torch.tensor(rows, device=table_row.device)
    return prefix, tail, _additive(keys[None, :] <= query[:, None], dtype)


def _split(
    blocks: torch.Tensor, kv_len: int, context: int, block_size: int
) -> tuple[list[Segment], Segment]:
    """Split a prefill's keys ``0 .. kv_len - 1`` into a prefix of consecutive block runs
    read as views, and a tail from the first run that reaches key ``context``
    (``seq_len - q_len`` for the last ``q_len`` positions).

    Every query sees all keys before ``context`` and key ``context`` itself, so the prefix
    needs no mask and no row of the tail is fully masked (its logsumexp stays finite). A
    table of many short runs (more than ``_MAX_RUNS``) is gathered whole instead: one call
    per run would cost more than the copy.
    """
    ids = blocks.tolist()
    starts = [j for j in range(len(ids)) if j == 0 or ids[j] != ids[j - 1] + 1]
    prefix: list[Segment] = []
    for j, next_j in itertools.pairwise([*starts, len(ids)]):
        if next_j * block_size > context or len(starts) > _MAX_RUNS:
            tail = (
                blocks[j:].long() if len(prefix) + 1 < len(starts) else slice(ids[j], ids[-1] + 1)
            )
            return prefix, (tail, kv_len - j * block_size)
        prefix.append((slice(ids[j], ids[j] + next_j - j), (next_j - j) * block_size))
    raise AssertionError("unreachable: the last run holds the last query's key")


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # SDPA turns a boolean mask into this 0 / -inf float mask on every call; build it once.
    zeros = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return zeros.masked_fill_(~visible, float("-inf"))


def _plan_decode(
    block_table: torch.Tensor,
    cu: list[int],
    lens: list[int],
    n_blocks: list[int],
    seqs: list[int],
    block_size: int,
    dtype: torch.dtype,
) -> _DecodeBatch:
    device = block_table.device
    max_blocks = max(n_blocks[i] for i in seqs)
    idx = torch.tensor(seqs, device=device)
    table = block_table[idx, :max_blocks].long()
    needed = torch.tensor([n_blocks[i] for i in seqs], device=device)
    columns = torch.arange(max_blocks, device=device)
    table = torch.where(columns < needed[:, None], table, table[:, :1])
    past_end = mask = None
    padded = max_blocks * block_size
    if any(lens[i] != padded for i in seqs):
        seq_lens = torch.tensor([lens[i] for i in seqs], device=device)
        positions = torch.arange(padded, device=device)
        visible = positions < seq_lens[:, None]
        past_end = (~visible).flatten().nonzero().flatten()
        mask = _additive(visible.view(len(seqs), 1, 1, padded), dtype)
    rows = torch.tensor([cu[i] for i in seqs], device=device)
    return _DecodeBatch(rows, table.flatten(), past_end, mask)


def _decode_gathered(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: _DecodeBatch,
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


def _consecutive_runs(
    block_table: torch.Tensor, n_blocks: list[int]
) -> tuple[list[int], list[bool]]:
    """Per sequence: its first block id and whether its ``n_blocks`` ids are consecutive."""
    first = block_table[:, 0].tolist() if block_table.shape[1] else [0] * len(n_blocks)
    if block_table.shape[1] <= 1:
        return first, [True] * len(n_blocks)
    breaks = block_table[:, 1:] - block_table[:, :-1] != 1
    breaks = torch.cat([breaks, torch.ones_like(breaks[:, :1])], dim=1)
    run_len = (breaks.to(torch.uint8).argmax(dim=1) + 1).tolist()
    return first, [run >= n for run, n in zip(run_len, n_blocks, strict=True)]


def _to_list(x: IntSeq) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


# ---------------------------------------------------------------------------------------
# Triton: one varlen kernel for prefill-with-prefix and decode.


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: IntSeq,
    seq_lens: IntSeq,
    scale: float,
    max_seqlen_q: int | None = None,
    q_positions: IntSeq | None = None,
) -> torch.Tensor:
    """Triton path of :func:`paged_attention`.

    Grid: (sequence, query tile, KV head). Each program packs the ``G`` query heads that
    share its KV head with ``BLOCK_Q`` query tokens into ``BLOCK_M = BLOCK_Q * G`` rows, and
    runs an online softmax over KV tiles read through the block table. ``q_positions``
    selects a second specialization of the kernel (a constexpr flag), so the default one
    compiles exactly as without it; positions are not range-checked here (no host sync).
    """
    cu = _to_device(cu_seqlens_q, q.device)
    lens = _to_device(seq_lens, q.device)
    if max_seqlen_q is None:
        max_seqlen_q = int((cu[1:] - cu[:-1]).max()) if len(lens) else 0
    out = torch.empty_like(q)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_m = max(16, next_power_of_2(group))
    block_q = block_m // group
    if len(lens) == 0 or max_seqlen_q == 0:
        return out
    grid = (len(lens), triton.cdiv(max_seqlen_q, block_q), num_kv_heads)
    positions = cu if q_positions is None else _to_device(q_positions, q.device)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_table, cu, lens, positions, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], block_table.stride(0),
        group, head_dim, k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=32,
        BLOCK_D=max(16, next_power_of_2(head_dim)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        HAS_Q_POSITIONS=q_positions is not None,
    )  # fmt: skip
    return out


def _to_device(x: IntSeq, device: torch.device) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=torch.int32)
    return torch.tensor(list(x), device=device, dtype=torch.int32)


if triton is not None:

    @triton.jit
    def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_table_ptr, cu_seqlens_q_ptr, seq_lens_ptr,
        q_positions_ptr, scale,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh,
        stride_bt,
        group, head_dim, block_size,
        BLOCK_M: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PRECISION: tl.constexpr,
        HAS_Q_POSITIONS: tl.constexpr,
    ):  # fmt: skip
        seq = tl.program_id(0).to(tl.int64)
        q_tile = tl.program_id(1)
        kv_head = tl.program_id(2).to(tl.int64)
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        if q_tile * BLOCK_Q >= q_len:
            return
        seq_len = tl.load(seq_lens_ptr + seq)
        context = seq_len - q_len

        # Row r of the tile is query token r // group of the tile, head kv_head*group + r % group.
        rows = tl.arange(0, BLOCK_M)
        tok = q_tile * BLOCK_Q + rows // group
        head = kv_head * group + rows % group
        row_ok = (rows // group < BLOCK_Q) & (tok < q_len)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        q_rows = (q_start + tok).to(tl.int64)
        q_tile_ptr = q_ptr + (q_rows * stride_qt + head * stride_qh)[:, None] + d[None, :]
        qv = tl.load(q_tile_ptr, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if HAS_Q_POSITIONS:
            # Padding rows get position 0 (they see key 0), so every row's max stays finite.
            q_pos = tl.load(q_positions_ptr + q_start + tok, mask=row_ok, other=0)
            kv_end = tl.minimum(seq_len, tl.max(q_pos, axis=0) + 1)
        else:
            q_pos = context + tok
            # Keys past the tile's last query position are masked for every row: skip them.
            kv_end = tl.minimum(seq_len, context + (q_tile + 1) * BLOCK_Q)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        qk_scale = scale * 1.4426950408889634  # exp2 instead of exp
        table_row = block_table_ptr + seq * stride_bt
        for kv_start in range(0, kv_end, BLOCK_N):
            k_pos = kv_start + tl.arange(0, BLOCK_N)
            k_ok = k_pos < kv_end
            block = tl.load(table_row + k_pos // block_size, mask=k_ok, other=0).to(tl.int64)
            in_block = (k_pos % block_size).to(tl.int64)
            k_off = block * stride_kb + in_block * stride_ks + kv_head * stride_kh
            v_off = block * stride_vb + in_block * stride_vs + kv_head * stride_vh
            kt = tl.load(
                k_cache_ptr + k_off[None, :] + d[:, None],
                mask=k_ok[None, :] & d_ok[:, None],
                other=0.0,
            )
            s = tl.dot(qv, kt, input_precision=PRECISION) * qk_scale
            visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
            s = tl.where(visible, s, float("-inf"))
            # Key 0 is visible to every row in the first tile, so m_new is always finite.
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            vv = tl.load(
                v_cache_ptr + v_off[:, None] + d[None, :],
                mask=k_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv, input_precision=PRECISION)
            m_i = m_new

        acc = acc / l_i[:, None]
        out_tile_ptr = out_ptr + (q_rows * stride_ot + head * stride_oh)[:, None] + d[None, :]
        tl.store(
            out_tile_ptr, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :]
        )
