"""Paged-KV kernels: Triton on CUDA, exact torch references on CPU.

Every op picks its backend from the tensors' device (``backend="auto"``) and can be forced
with ``backend="triton"`` or ``backend="torch"``. Importing this package never needs triton.
"""

if __name__ == "kernels":  # this checkout's root is on sys.path, shadowing a real package
    raise ImportError(
        "`import kernels` found ragkv's source directory, not Hugging Face's `kernels` package "
        f"(which transformers imports): {__file__}. Run Python from outside the ragkv "
        "checkout's root, or with `python -P` / PYTHONSAFEPATH=1 so the current directory "
        "stays off sys.path."
    )

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
