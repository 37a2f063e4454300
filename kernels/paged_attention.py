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

:func:`paged_attention` checks the arguments and dispatches: the Triton kernel is in
:mod:`~ragkv.kernels.paged_attention_triton`, the torch reference in
:mod:`~ragkv.kernels.paged_attention_torch`. The torch path works from an
:class:`AttentionPlan` of the step's metadata (:mod:`~ragkv.kernels.attention_plan`): a
caller that runs many layers over one step (the engine's model runner) builds it once with
:func:`plan_attention` and passes it to every layer.
"""

from __future__ import annotations

import torch

from ragkv.errors import InvalidInputError
from ragkv.kernels.attention_plan import AttentionPlan, IntSeq, plan_attention
from ragkv.kernels.dispatch import Backend, check_cache, use_triton
from ragkv.kernels.paged_attention_torch import paged_attention_torch
from ragkv.kernels.paged_attention_triton import paged_attention_triton

__all__ = [
    "AttentionPlan",
    "IntSeq",
    "paged_attention",
    "paged_attention_torch",
    "paged_attention_triton",
    "plan_attention",
]


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
