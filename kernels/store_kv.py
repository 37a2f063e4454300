"""store_kv: write the new tokens' K/V into their slots of the paged cache.

Slot ``s`` is token ``s % block_size`` of block ``s // block_size``; slot -1 marks padding
and is skipped. Triton kernel and torch reference side by side; :func:`store_kv` dispatches.
"""

from __future__ import annotations

import torch

from ragkv.errors import InvalidInputError
from ragkv.kernels.dispatch import Backend, check_cache, next_power_of_2, tl, triton, use_triton


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: Backend = "auto",
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the paged caches.

    ``k_cache``/``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``;
    ``slot_mapping`` is an integer tensor ``[num_tokens]`` of flat slots, -1 = skip.
    ``backend``: "auto" (Triton on CUDA, torch otherwise), "triton" or "torch".
    """
    check_cache(k_cache, v_cache)
    if key.shape != value.shape or key.shape[1:] != k_cache.shape[2:]:
        raise InvalidInputError(
            f"key/value must be [num_tokens, {k_cache.shape[2]}, {k_cache.shape[3]}]; "
            f"got {tuple(key.shape)} and {tuple(value.shape)}."
        )
    if slot_mapping.shape != (key.shape[0],):
        raise InvalidInputError(
            f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}."
        )
    if key.shape[0] == 0:
        return
    if use_triton(backend, key):
        store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        store_kv_torch(key, value, k_cache, v_cache, slot_mapping)


def store_kv_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Torch reference of :func:`store_kv` (the CPU path)."""
    slots = slot_mapping.long()
    valid = slots >= 0
    if not bool(valid.all()):
        key, value, slots = key[valid], value[valid], slots[valid]
    for src, cache in ((key, k_cache), (value, v_cache)):
        if cache.stride(0) == cache.shape[1] * cache.stride(1):
            # Blocks and slots merge into one axis: a single index_copy_ into a view.
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, src.to(cache.dtype))
        else:
            block_size = cache.shape[1]
            cache[slots // block_size, slots % block_size] = src.to(cache.dtype)


def store_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton path of :func:`store_kv`: one program per token."""
    num_tokens, num_kv_heads, head_dim = key.shape
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        k_cache.shape[1], num_kv_heads, head_dim,
        BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_dim),
    )  # fmt: skip


if triton is not None:

    @triton.jit
    def _store_kv_kernel(
        key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
        stride_kt, stride_kh, stride_kd,
        stride_vt, stride_vh, stride_vd,
        stride_kc_b, stride_kc_s, stride_kc_h,
        stride_vc_b, stride_vc_s, stride_vc_h,
        block_size, num_kv_heads, head_dim,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot < 0:
            return
        block = slot // block_size
        offset = slot % block_size
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < num_kv_heads) & (d < head_dim)

        k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
        v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
        k_dst = k_cache_ptr + block * stride_kc_b + offset * stride_kc_s + h * stride_kc_h + d
        v_dst = v_cache_ptr + block * stride_vc_b + offset * stride_vc_s + h * stride_vc_h + d
        tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
