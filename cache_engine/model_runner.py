"""Loads a Hugging Face causal LM, owns its paged KV tensors, and runs one varlen step.

A step is a flattened batch ``[1, num_tokens]`` with explicit position ids: the slices of
all scheduled requests back to back. Per-step metadata travels to every attention layer
as :class:`~ragkv.cache_engine.attention.StepContext`; the LM head runs only on the rows
that are needed (the last row of each sampling request, or every row of a request that
asked for its logits).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ragkv.cache_engine.attention import ATTN_IMPLEMENTATION, StepContext, register_attention

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelInput:
    """Host-side description of one step, built by the engine from the scheduled slices."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    cu_seqlens_q: list[int] = field(default_factory=lambda: [0])
    seq_lens: list[int] = field(default_factory=list)
    logits_rows: list[int] = field(default_factory=list)  # flat token rows to project


class ModelRunner:
    """One model, its KV pool, and the forward pass over paged attention."""

    def __init__(
        self,
        path: Path,
        *,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        num_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        backend: str = "auto",
    ) -> None:
        from transformers import AutoModelForCausalLM

        register_attention()
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.backend = backend
        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION
        ).to(device)
        self.model.eval()
        config = self.model.config
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.vocab_size = config.vocab_size
        if num_blocks is None:
            num_blocks = max(1, (kv_cache_bytes or 0) // self.bytes_per_block())
        self.num_blocks = num_blocks
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        # Allocated once; nothing grows past it (invariant 5).
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(self.num_layers)
        ]
        logger.info(
            "KV pool: %d blocks x %d tokens, %.1f MiB",
            num_blocks,
            block_size,
            num_blocks * self.bytes_per_block() / 2**20,
        )

    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

    def _metadata(self, values: list[int]) -> torch.Tensor | list[int]:
        # The torch (CPU) attention path takes host lists directly: no tensor round trip
        # per layer. Device kernels get one int32 tensor per step.
        if self.device.type == "cpu":
            return values
        return torch.tensor(values, dtype=torch.int32, device=self.device)

    @torch.inference_mode()
    def execute(self, batch: ModelInput) -> torch.Tensor:
        """Run one step; returns fp32 logits ``[len(batch.logits_rows), vocab]``."""
        device = self.device
        max_blocks = max(len(t) for t in batch.block_tables)
        padded = [blocks + [0] * (max_blocks - len(blocks)) for blocks in batch.block_tables]
        lengths_q = [b - a for a, b in itertools.pairwise(batch.cu_seqlens_q)]
        step = StepContext(
            kv_caches=self.kv_caches,
            slot_mapping=torch.tensor(batch.slot_mapping, dtype=torch.int64, device=device),
            block_table=torch.tensor(padded, dtype=torch.int32, device=device),
            cu_seqlens_q=self._metadata(batch.cu_seqlens_q),
            seq_lens=self._metadata(batch.seq_lens),
            max_seqlen_q=max(lengths_q),
            max_seqlen_k=max(batch.seq_lens),
            backend=self.backend,
        )
        input_ids = torch.tensor([batch.input_ids], dtype=torch.long, device=device)
        positions = torch.tensor([batch.positions], dtype=torch.long, device=device)
        rows = torch.tensor(batch.logits_rows, dtype=torch.long, device=device)
        out = self.model(
            input_ids=input_ids,
            position_ids=positions,
            use_cache=False,
            logits_to_keep=rows,
            ragkv_step=step,
        )
        return out.logits[0].float()
