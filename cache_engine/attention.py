"""Paged attention inside any supported Hugging Face model, via transformers' attention interface.

The model runner loads the model with ``attn_implementation="ragkv_paged"`` and passes one
:class:`StepContext` per forward call as the ``ragkv_step`` keyword argument; transformers
forwards unknown keyword arguments from the model's ``forward`` down to every attention
call. Each layer then (1) writes the step's new K/V into its paged cache and (2) attends
over cached prefix + new tokens through the block table. The model never sees a
transformers cache object, and no attention mask is materialized (the custom
implementation is not in transformers' mask registry, so the mask is ``None``).

A compiled forward (``EngineConfig.compile``, :mod:`~ragkv.cache_engine.compiled_forward`)
cannot pass the context as an argument: TorchDynamo would trace the paged attention's
Python (plans, host lists) and break the graph at every layer. It sets the context for
the calling thread with :func:`step_scope` instead, and each layer calls the custom op
``ragkv::paged_attention``, which the compiler treats as opaque (as vLLM's unified
attention op does). The op writes the layer's K/V into the cache it reads from the
context; no graph value depends on that write except through the op's own output, and
layer ``i + 1``'s op needs layer ``i``'s output, so the compiler cannot reorder them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import AttentionInterface

from ragkv.errors import RagkvError
from ragkv.kernels import AttentionPlan, paged_attention, store_kv
from ragkv.kernels.dispatch import Backend

ATTN_IMPLEMENTATION = "ragkv_paged"


class AttentionLayer(Protocol):
    """What the attention function reads from the calling transformers attention module."""

    layer_idx: int


@dataclass(slots=True)
class StepContext:
    """Per-step metadata shared by all layers of one forward pass (a flattened varlen batch)."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k_cache, v_cache), NHD
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    block_table: torch.Tensor  # int32 [num_seqs, max_blocks]
    cu_seqlens_q: torch.Tensor | list[int]  # [num_seqs + 1]; host list on CPU
    seq_lens: torch.Tensor | list[int]  # [num_seqs]; host list on CPU
    max_seqlen_q: int
    max_seqlen_k: int
    backend: Backend = "auto"
    plan: AttentionPlan | None = None  # torch path: built once per step, read by every layer
    # Explicit query position per token row (chunk reuse); None: each sequence's rows are its
    # last q_len positions. Host list on CPU (the plan's own list), int32 tensor on a device.
    q_positions: torch.Tensor | list[int] | None = None
    # A probe forward (chunk reuse's deviation): stop once this layer has stored its K/V.
    stop_after_layer: int | None = None


class ProbeDone(Exception):
    """Raised by layer ``StepContext.stop_after_layer`` once its K/V are stored: a probe
    forward needs nothing past them (the caller catches it; the model's outputs are unused).
    An exception is the one way to leave a transformers forward early without knowing the
    model's layer structure."""


def paged_attention_forward(
    module: AttentionLayer,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    ragkv_step: StepContext | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Attention function registered with transformers; shapes follow its interface.

    ``query`` is ``[1, num_heads, num_tokens, head_dim]`` (post-RoPE), ``key``/``value``
    ``[1, num_kv_heads, num_tokens, head_dim]``; returns ``[1, num_tokens, num_heads, head_dim]``.
    """
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if ragkv_step is None:  # a compiled forward: the step is in scope (step_scope)
        out = torch.ops.ragkv.paged_attention(query, key, value, module.layer_idx, scale)
        return out, None
    return attend(ragkv_step, module.layer_idx, query, key, value, scale), None


def attend(
    step: StepContext,
    layer_idx: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Store one layer's new K/V and attend over the paged cache (shapes as
    :func:`paged_attention_forward`'s); returns ``[1, num_tokens, num_heads, head_dim]``."""
    k_cache, v_cache = step.kv_caches[layer_idx]
    q = query[0].transpose(0, 1)
    store_kv(
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        k_cache,
        v_cache,
        step.slot_mapping,
        backend=step.backend,
    )
    if step.stop_after_layer == layer_idx:
        raise ProbeDone
    out = paged_attention(
        q,
        k_cache,
        v_cache,
        step.block_table,
        step.cu_seqlens_q,
        step.seq_lens,
        scale,
        max_seqlen_q=step.max_seqlen_q,
        max_seqlen_k=step.max_seqlen_k,
        backend=step.backend,
        plan=step.plan,
        q_positions=step.q_positions,
    )
    return out.unsqueeze(0)


_scope = threading.local()  # the step of the compiled forward running in this thread


@contextmanager
def step_scope(step: StepContext) -> Iterator[None]:
    """Make ``step`` the context of every ``ragkv::paged_attention`` call in this thread."""
    previous = getattr(_scope, "step", None)
    _scope.step = step
    try:
        yield
    finally:
        _scope.step = previous


@torch.library.custom_op("ragkv::paged_attention", mutates_args=())
def paged_attention_op(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int, scale: float
) -> torch.Tensor:
    """:func:`attend` with the step in scope: the op a compiled forward calls per layer."""
    step = getattr(_scope, "step", None)
    if step is None:
        raise RagkvError(
            "the ragkv_paged attention implementation needs step metadata; run the model "
            "through ragkv.cache_engine.Engine instead of calling it directly"
        )
    return attend(step, layer_idx, query, key, value, scale)


@paged_attention_op.register_fake
def _(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int, scale: float
) -> torch.Tensor:
    _, num_heads, num_tokens, head_dim = query.shape
    return query.new_empty(1, num_tokens, num_heads, head_dim)


def register_attention() -> str:
    """Register the paged attention with transformers (idempotent); returns its name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
