"""Backend choice shared by the ops: Triton for CUDA tensors, torch everywhere else.

``triton`` is imported here, once, and is None on CPU-only installs (``import
ragkv.kernels`` works there; the torch references never need triton): the op modules take
``triton``/``tl`` from here and define their kernels only when it is not None.
"""

from __future__ import annotations

from typing import Literal

import torch

from ragkv.errors import ConfigError, InvalidInputError

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the torch references need no triton
    triton = tl = None

Backend = Literal["auto", "triton", "torch"]


def triton_available() -> bool:
    """Whether ``triton`` can be imported here."""
    return triton is not None


def use_triton(backend: Backend, *tensors: torch.Tensor) -> bool:
    """Resolve ``backend``: "auto" picks Triton for CUDA tensors and torch otherwise."""
    if backend == "torch":
        return False
    if backend == "triton":
        if not triton_available():
            raise ConfigError("backend='triton' needs the triton package; use backend='torch'.")
        return True
    if backend != "auto":
        raise ConfigError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}.")
    return tensors[0].is_cuda and triton_available()


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (Triton block shapes must be powers of two)."""
    return 1 << max(n - 1, 0).bit_length()


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Validate the NHD paged layout ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise InvalidInputError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]; "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}."
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise InvalidInputError("the head_dim axis of the KV cache must be contiguous.")
