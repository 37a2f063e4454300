"""Loads a Hugging Face causal LM, owns its paged KV tensors, and runs one step: the
scheduled slices in, one sampled token per finishing slice out.

A step is a flattened batch ``[1, num_tokens]`` with explicit position ids: the slices of
all scheduled requests back to back. Its inputs and its attention metadata (with the
torch path's :class:`~ragkv.kernels.AttentionPlan`) are built once, here, and travel to
every attention layer as :class:`~ragkv.cache_engine.attention.StepContext`; the LM head
runs only on the rows that are needed (the last row of each sampling request, or every
row of a request that asked for its logits).
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ragkv.cache_engine.attention import (
    ATTN_IMPLEMENTATION,
    ProbeDone,
    StepContext,
    register_attention,
)
from ragkv.cache_engine.chunk_reuse.deviation import choose_by_deviation
from ragkv.cache_engine.chunk_reuse.placement import place_chunks
from ragkv.cache_engine.compiled_forward import CompiledForward
from ragkv.cache_engine.config import EngineConfig, default_kv_bytes, resolve_device, resolve_dtype
from ragkv.cache_engine.kv_cache_manager import slot_mapping
from ragkv.cache_engine.model_support import (
    check_files,
    check_supported,
    model_identity,
    read_config,
)
from ragkv.cache_engine.packed_linear import can_prepack, prepack_linears
from ragkv.cache_engine.sampler import Sampler, SamplerOutput, TokenLogprobs
from ragkv.cache_engine.step import ScheduledSlice, SchedulerOutput
from ragkv.errors import ConfigError, InvalidInputError
from ragkv.kernels import plan_attention
from ragkv.kernels.dispatch import Backend, use_triton

if TYPE_CHECKING:
    from ragkv.cache_engine.rope import RopeRotator

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelInput:
    """Host-side description of one step, built from the scheduled slices."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    cu_seqlens_q: list[int] = field(default_factory=lambda: [0])
    seq_lens: list[int] = field(default_factory=list)
    logits_rows: list[int] = field(default_factory=list)  # flat token rows to project
    sample_rows: list[int] = field(default_factory=list)  # per sampling chunk, into logits rows
    kept_rows: list[range | None] = field(default_factory=list)  # per chunk: return_logits rows
    # Set when a chunk gave explicit positions: attention then takes ``positions`` as the
    # query positions of the whole step (causal by position, see paged_attention).
    explicit_positions: bool = False


@dataclass(slots=True)
class StepResult:
    """What a step computed: the token (and its logprobs, when asked) of each sampling chunk
    in order, and per chunk the fp32 logits rows kept for ``return_logits`` (or None)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    logits: list[torch.Tensor | None]
    forward_s: float = 0.0  # wall time of the model forward alone


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
        backend: Backend = "auto",
        compile: bool = False,
        prepack_linear: bool = False,
    ) -> None:
        from transformers import AutoModelForCausalLM

        register_attention()
        self.path, self.model_name = path, path.name
        self.max_model_len = 0  # from_config sets these from the checkpoint's config.json
        self.identity = b""
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.backend = backend
        # The ignore: transformers wraps PreTrainedModel.to with functools.wraps, which
        # typeshed types as the unbound torch.nn.Module.to (self expected first).
        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION
        ).to(device)  # type: ignore[arg-type]
        self.model.eval()
        config = self.model.config
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.vocab_size = config.vocab_size
        self.sampler = Sampler()
        self._rotator: RopeRotator | None = (
            None  # RoPE re-rotation for chunk reuse, built on first use
        )
        if num_blocks is None:
            num_blocks = max(1, (kv_cache_bytes or 0) // self.bytes_per_block())
        self.num_blocks = num_blocks
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        # Allocated once; nothing grows past it (Invariant 5).
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(self.num_layers)
        ]
        self.prepacked = prepack_linear and not compile and can_prepack(device, dtype)
        if self.prepacked:
            prepack_linears(self.model)
        self.compiled: CompiledForward | None = None
        if compile:
            self.compiled = CompiledForward(self.model)
            self.compiled.warm_up(self._scratch_forward)
        logger.info(
            "KV pool: %d blocks x %d tokens, %.1f MiB",
            num_blocks,
            block_size,
            num_blocks * self.bytes_per_block() / 2**20,
        )

    @classmethod
    def from_config(cls, config: EngineConfig) -> ModelRunner:
        """Check the checkpoint, resolve device, dtype and pool size, load the model.

        Sets ``path``, ``model_name``, ``max_model_len`` (the config's, or the model's
        context) and ``identity`` (the model's part of every block hash).
        """
        name = None
        if config.model is None:
            from ragkv.cache_engine.default_model import DEFAULT_MODEL_NAME, default_model_path

            path = Path(default_model_path())
            # The converted copy's directory carries a fingerprint; clients see the model.
            if path.name.startswith(DEFAULT_MODEL_NAME):
                name = DEFAULT_MODEL_NAME
        else:
            path = Path(config.model).expanduser()
        model_config = read_config(path)
        check_supported(model_config)
        check_files(path)
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        context = int(model_config.get("max_position_embeddings") or 2048)
        if config.max_model_len is not None and config.max_model_len > context:
            raise ConfigError(
                f"max_model_len must be between 2 and the model context ({context} tokens), "
                f"got {config.max_model_len}",
                param="max_model_len",
            )
        tokens, kv_bytes = config.kv_cache_tokens, config.kv_cache_bytes
        if tokens is None and kv_bytes is None:
            kv_bytes = default_kv_bytes(device)
        runner = cls(
            path,
            device=device,
            dtype=dtype,
            block_size=config.block_size,
            num_blocks=None if tokens is None else tokens // config.block_size,
            kv_cache_bytes=kv_bytes,
            backend=config.backend,
            compile=config.compile,
            prepack_linear=config.prepack_linear,
        )
        runner.path = path
        runner.model_name = name or model_config.get("_name_or_path") or path.name
        runner.max_model_len = config.max_model_len or context
        runner.identity = model_identity(path, model_config, str(dtype))
        return runner

    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

    def eos_token_ids(self, tokenizer: Any) -> frozenset[int]:
        """The model's EOS ids: its generation config's, its config's and the tokenizer's."""
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.model.config):
            eos = getattr(source, "eos_token_id", None)
            if eos is not None:
                ids.update([eos] if isinstance(eos, int) else eos)
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        return frozenset(ids)

    def execute(self, batch: SchedulerOutput) -> StepResult:
        """Run one step: build its inputs, run the model, sample every finishing slice."""
        self.place_reused_chunks(batch.slices)  # first: a deviation plan picks positions
        inputs = self.prepare(batch.slices)
        started = time.perf_counter()
        logits = self.forward(inputs)
        forward_s = time.perf_counter() - started
        sampling = [chunk.request for chunk in batch.slices if chunk.samples]
        sampled = SamplerOutput([], [])
        if sampling:
            sampled = self.sampler(
                logits[inputs.sample_rows],
                [r.params for r in sampling],
                [r.generator for r in sampling],
            )
        kept = [
            None if rows is None else logits[rows.start : rows.stop].clone()
            for rows in inputs.kept_rows
        ]
        return StepResult(sampled.token_ids, sampled.logprobs, kept, forward_s)

    def place_reused_chunks(self, chunks: list[ScheduledSlice]) -> None:
        """Copy the K/V of chunks reused from elsewhere into their new positions, keys
        re-rotated (opt-in chunk reuse), before the forward that attends over them."""
        for chunk in chunks:
            plan = chunk.request.blend
            if plan is None or plan.placed:
                continue
            if self._rotator is None:
                from ragkv.cache_engine.rope import RopeRotator

                self._rotator = RopeRotator.from_model(self.model)
            place_chunks(
                plan, chunk.block_table, self.kv_caches, self._rotator.rotate, self.block_size
            )
            plan.placed = True
            if plan.choose:  # deviation: probe, then recompute the tokens that deviate most
                probe = functools.partial(self.probe, chunk, plan.start)
                choose_by_deviation(plan, chunk.block_table, self.kv_caches, self.block_size, probe)
                chunk.positions = plan.positions

    @torch.inference_mode()
    def probe(self, chunk: ScheduledSlice, start: int, layer: int) -> None:
        """Compute the K/V of layers ``0..layer`` of positions ``start .. chunk.end - 1`` in
        one forward that stops there (chunk reuse's deviation probe): the layers' paged
        cache then holds fresh K/V for those positions; nothing else is computed."""
        end = chunk.end
        batch = ModelInput(
            input_ids=chunk.request.token_ids[start:end],
            positions=list(range(start, end)),
            slot_mapping=slot_mapping(chunk.block_table, self.block_size, start, end),
            block_tables=[chunk.block_table],
            cu_seqlens_q=[0, end - start],
            seq_lens=[end],
            logits_rows=[end - start - 1],
        )
        try:
            self.forward(batch, stop_after_layer=layer)
        except ProbeDone:
            return
        raise RuntimeError(f"the probe forward never reached layer {layer}")

    def prepare(self, chunks: list[ScheduledSlice]) -> ModelInput:
        """The step's flattened inputs: ids, positions, KV slots, block tables, logits rows.

        A chunk with explicit ``positions`` contributes its tokens at those positions, in
        that row order (kept logits rows too); its sampled row is the one at ``end - 1``.
        """
        batch = ModelInput()
        for chunk in chunks:
            request = chunk.request
            first_row = batch.cu_seqlens_q[-1]
            last_row = first_row + chunk.num_tokens - 1  # the row whose logits are sampled
            if chunk.positions is None:
                batch.input_ids.extend(request.token_ids[chunk.start : chunk.end])
                batch.positions.extend(range(chunk.start, chunk.end))
                batch.slot_mapping.extend(
                    slot_mapping(chunk.block_table, self.block_size, chunk.start, chunk.end)
                )
            else:
                last_row = first_row + self._add_positioned(batch, chunk)
            batch.block_tables.append(chunk.block_table)
            batch.cu_seqlens_q.append(first_row + chunk.num_tokens)
            batch.seq_lens.append(chunk.end)
            if request.keep_logits:
                start = len(batch.logits_rows)
                batch.logits_rows.extend(range(first_row, first_row + chunk.num_tokens))
                batch.kept_rows.append(range(start, len(batch.logits_rows)))
                if chunk.samples:
                    batch.sample_rows.append(start + last_row - first_row)
            else:
                batch.kept_rows.append(None)
                if chunk.samples:
                    batch.logits_rows.append(last_row)
                    batch.sample_rows.append(len(batch.logits_rows) - 1)
        return batch

    def _add_positioned(self, batch: ModelInput, chunk: ScheduledSlice) -> int:
        """Append a chunk's tokens at its explicit positions; returns the offset of its
        sampled row (the one at position ``end - 1``) within the chunk, or its last row's
        when it does not sample."""
        positions, token_ids, end = chunk.positions, chunk.request.token_ids, chunk.end
        assert positions is not None  # the caller takes this path only for explicit positions
        if (
            len(positions) != chunk.num_tokens
            or len(set(positions)) != len(positions)
            or (positions and (min(positions) < 0 or max(positions) >= end))
        ):
            raise InvalidInputError(
                f"ScheduledSlice.positions must hold num_tokens={chunk.num_tokens} distinct "
                f"positions in [0, {end}); got {len(positions)}",
                param="positions",
            )
        batch.explicit_positions = True
        batch.input_ids.extend(token_ids[p] for p in positions)
        batch.positions.extend(positions)
        table, size = chunk.block_table, self.block_size
        batch.slot_mapping.extend(table[p // size] * size + p % size for p in positions)
        if not chunk.samples:
            return chunk.num_tokens - 1
        if positions[-1] == end - 1:
            return chunk.num_tokens - 1
        if end - 1 not in positions:
            raise InvalidInputError(
                f"a slice that samples must compute position {end - 1} (its last token)",
                param="positions",
            )
        return positions.index(end - 1)

    def _metadata(self, values: list[int]) -> torch.Tensor | list[int]:
        # The torch (CPU) attention path takes host lists directly: no tensor round trip
        # per layer. Device kernels get one int32 tensor per step.
        if self.device.type == "cpu":
            return values
        return torch.tensor(values, dtype=torch.int32, device=self.device)

    def step_context(self, batch: ModelInput) -> StepContext:
        """The attention metadata of one step, shared by every layer."""
        device = self.device
        max_blocks = max(len(t) for t in batch.block_tables)
        padded = [blocks + [0] * (max_blocks - len(blocks)) for blocks in batch.block_tables]
        lengths_q = [b - a for a, b in itertools.pairwise(batch.cu_seqlens_q)]
        block_table = torch.tensor(padded, dtype=torch.int32, device=device)
        q_positions = None
        if batch.explicit_positions:
            q_positions = self._metadata(batch.positions)
        plan = None
        if not use_triton(self.backend, block_table):
            plan = plan_attention(
                block_table,
                batch.cu_seqlens_q,
                batch.seq_lens,
                self.block_size,
                self.dtype,
                batch.positions if batch.explicit_positions else None,
            )
        return StepContext(
            kv_caches=self.kv_caches,
            slot_mapping=torch.tensor(batch.slot_mapping, dtype=torch.int64, device=device),
            block_table=block_table,
            cu_seqlens_q=self._metadata(batch.cu_seqlens_q),
            seq_lens=self._metadata(batch.seq_lens),
            max_seqlen_q=max(lengths_q),
            max_seqlen_k=max(batch.seq_lens),
            backend=self.backend,
            plan=plan,
            q_positions=q_positions,
        )

    @torch.inference_mode()
    def forward(self, batch: ModelInput, stop_after_layer: int | None = None) -> torch.Tensor:
        """Run the model over one step; returns fp32 logits ``[len(batch.logits_rows), vocab]``.
        ``stop_after_layer``: a probe, which raises :class:`ProbeDone` once that layer has
        stored its K/V."""
        device = self.device
        step = self.step_context(batch)
        step.stop_after_layer = stop_after_layer
        input_ids = torch.tensor([batch.input_ids], dtype=torch.long, device=device)
        positions = torch.tensor([batch.positions], dtype=torch.long, device=device)
        rows = torch.tensor(batch.logits_rows, dtype=torch.long, device=device)
        if self.compiled is not None:
            return self.compiled(step, input_ids, positions, rows)[0].float()
        out = self.model(
            input_ids=input_ids,
            position_ids=positions,
            use_cache=False,
            logits_to_keep=rows,
            ragkv_step=step,
        )
        return out.logits[0].float()

    def _scratch_forward(self, num_tokens: int) -> None:
        """A forward of ``num_tokens`` tokens in block 0 of an empty pool (compile warm-up:
        no block holds anything yet, and the step writes only block 0)."""
        batch = ModelInput(
            input_ids=[0] * num_tokens,
            positions=list(range(num_tokens)),
            slot_mapping=list(range(num_tokens)),
            block_tables=[[0]],
            cu_seqlens_q=[0, num_tokens],
            seq_lens=[num_tokens],
            logits_rows=[num_tokens - 1],
        )
        self.forward(batch)
