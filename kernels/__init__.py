"""Paged-KV kernels: Triton on CUDA, exact torch references on CPU.

Every op picks its backend from the tensors' device (``backend="auto"``) and can be forced
with ``backend="triton"`` or ``backend="torch"``. Importing this package never needs triton.
"""

from ragkv.kernels.copy_blocks import copy_blocks
from ragkv.kernels.dispatch import Backend
from ragkv.kernels.paged_attention import AttentionPlan, paged_attention, plan_attention
from ragkv.kernels.store_kv import store_kv

__all__ = [
    "AttentionPlan",
    "Backend",
    "copy_blocks",
    "paged_attention",
    "plan_attention",
    "store_kv",
]
