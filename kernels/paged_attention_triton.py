"""The Triton path of :func:`~ragkv.kernels.paged_attention`: one varlen kernel for
prefill-with-prefix and decode (the semantics are in :mod:`ragkv.kernels.paged_attention`)."""

from __future__ import annotations

import torch

from ragkv.kernels.attention_plan import IntSeq
from ragkv.kernels.dispatch import next_power_of_2, tl, triton


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
