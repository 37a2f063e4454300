"""copy_blocks: copy whole KV blocks between caches (swap / offload tiers, copy-on-write).

Plain torch indexing is a single gather-scatter and as fast as a kernel on CPU, and the only
option across devices; the Triton kernel serves same-device CUDA copies without the
intermediate gathered tensor.

The engine does not call it: KV tiers move blocks through a staging tensor laid out as
the stored payload (``cache_engine/offload.py``), and chunk reuse re-rotates keys while it
copies (``cache_engine/chunk_reuse/placement.py``). It stays a tested public kernel for
cache-to-cache block moves (copy-on-write, swapping between two caches).
"""

from __future__ import annotations

import torch

from ragkv.errors import InvalidInputError
from ragkv.kernels.dispatch import Backend, tl, triton, use_triton


def copy_blocks(
    src_cache: torch.Tensor,
    dst_cache: torch.Tensor,
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
    backend: Backend = "auto",
) -> None:
    """Copy ``src_cache[src_ids[i]]`` into ``dst_cache[dst_ids[i]]`` for every ``i``.

    Both caches are ``[num_blocks, ...]`` with equal per-block shapes and dtypes (they may live
    on different devices; then the torch path is used). ``backend``: "auto" (Triton when both
    caches are on the same CUDA device), "triton" or "torch".
    """
    if src_cache.shape[1:] != dst_cache.shape[1:] or src_cache.dtype != dst_cache.dtype:
        raise InvalidInputError(
            f"caches must share block shape and dtype; got {tuple(src_cache.shape)} "
            f"{src_cache.dtype} and {tuple(dst_cache.shape)} {dst_cache.dtype}."
        )
    if src_ids.shape != dst_ids.shape or src_ids.dim() != 1:
        raise InvalidInputError("src_ids and dst_ids must be 1-D and of equal length.")
    if src_ids.numel() == 0:
        return
    same_device = src_cache.device == dst_cache.device
    if same_device and _blocks_contiguous(src_cache, dst_cache) and use_triton(backend, src_cache):
        copy_blocks_triton(src_cache, dst_cache, src_ids, dst_ids)
    else:
        copy_blocks_torch(src_cache, dst_cache, src_ids, dst_ids)


def copy_blocks_torch(
    src_cache: torch.Tensor, dst_cache: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor
) -> None:
    """Torch reference of :func:`copy_blocks`."""
    blocks = src_cache[src_ids.to(src_cache.device).long()]
    dst_cache.index_copy_(0, dst_ids.to(dst_cache.device).long(), blocks.to(dst_cache.device))


def copy_blocks_triton(
    src_cache: torch.Tensor, dst_cache: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor
) -> None:
    """Triton path of :func:`copy_blocks`: grid (pair, chunk of the block)."""
    block_numel = src_cache[0].numel()
    chunk = 1024
    grid = (src_ids.numel(), triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](
        src_cache, dst_cache, src_ids, dst_ids,
        src_cache.stride(0), dst_cache.stride(0), block_numel,
        CHUNK=chunk,
    )  # fmt: skip


def _blocks_contiguous(*caches: torch.Tensor) -> bool:
    """Each block is one contiguous run of memory (what the Triton kernel copies)."""
    return all(c[0].is_contiguous() for c in caches)


if triton is not None:

    @triton.jit
    def _copy_blocks_kernel(
        src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr,
        stride_src, stride_dst, block_numel,
        CHUNK: tl.constexpr,
    ):  # fmt: skip
        pair = tl.program_id(0)
        offs = tl.program_id(1).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
        mask = offs < block_numel
        src = tl.load(src_ids_ptr + pair).to(tl.int64)
        dst = tl.load(dst_ids_ptr + pair).to(tl.int64)
        x = tl.load(src_ptr + src * stride_src + offs, mask=mask)
        tl.store(dst_ptr + dst * stride_dst + offs, x, mask=mask)
