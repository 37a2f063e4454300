"""AttentionPlan: what one step's attention metadata implies for the torch path.

Run detection (which blocks of a sequence are consecutive, read as views), index tensors
for the batched decode gather, and the additive causal or position masks depend only on the
step's metadata, never on a layer's K/V: :func:`plan_attention` builds them once per step
and every layer's :func:`~ragkv.kernels.paged_attention_torch.paged_attention_torch`
reads them. The attention semantics (bottom-right causal, ``q_positions``) are described in
:mod:`ragkv.kernels.paged_attention`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ragkv.errors import InvalidInputError

IntSeq = torch.Tensor | Sequence[int]

Segment = tuple[slice | torch.Tensor, int]  # blocks (a range, or ids to gather), tokens read


@dataclass(slots=True)
class DecodeBatch:
    """Index tensors of one padded decode gather (see :func:`~ragkv.kernels.paged_attention_torch.decode_gathered`)."""

    rows: torch.Tensor  # [batch] query rows of the decode sequences
    blocks: torch.Tensor  # [batch * max_blocks] block ids, padding -> the row's first block
    tokens: int  # key slots read per row: the longest sequence (a prefix of the blocks)
    past_end: torch.Tensor | None  # flat slots of the gather past each sequence's length
    mask: torch.Tensor | None  # additive [batch, 1, 1, tokens]
    # K, V gather buffers, allocated by the step's first layer and refilled by each: a plan
    # serves one forward at a time.
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(slots=True)
class AttentionPlan:
    """What one step's metadata implies for the torch path, identical for every layer.

    Building it (run detection, index tensors, causal masks) costs more than a layer's
    gathers, and a ``[q_len, kv_len]`` mask rebuilt per layer more than the SDPA it serves,
    so a step builds one plan and hands it to all its layers, one after another (its decode
    gathers refill buffers it holds). It describes the table it was built from: a table
    edited afterwards needs a new plan.
    """

    # Per sequence not in ``decodes``: (q start, q end, its keys, mask or None).
    seqs: list[tuple[int, int, Segment, torch.Tensor | None]]
    decodes: list[DecodeBatch]
    q_positions: list[int] | None = None  # the explicit query positions it was built for


def plan_attention(
    block_table: torch.Tensor,
    cu_seqlens_q: IntSeq,
    seq_lens: IntSeq,
    block_size: int,
    dtype: torch.dtype,
    q_positions: IntSeq | None = None,
) -> AttentionPlan:
    """The torch path's plan for one step's metadata (arguments as :func:`paged_attention`'s;
    ``dtype`` is the query's).

    Decode sequences (one query row, at its last position) are batched into padded decode
    gathers, each of sequences at least half as long as its longest (padding costs at most
    as much as the keys); every other sequence reads its keys as one segment (a view of
    consecutive blocks, else a gather) under one mask, so each costs a single SDPA call. With
    ``q_positions``, a sequence whose rows are exactly its last ``q_len`` positions in order
    is planned as without them (same segments, same results); any other sequence gets a
    position mask over its keys ``0 .. max(position)``.
    """
    cu, lens = to_list(cu_seqlens_q), to_list(seq_lens)
    positions: list[int] | None = None
    positioned: set[int] = set()
    if q_positions is not None:
        positions = q_positions if isinstance(q_positions, list) else to_list(q_positions)
        positioned = _positioned_seqs(positions, cu, lens)
    device = block_table.device
    decode_seqs = [i for i in range(len(lens)) if cu[i + 1] - cu[i] == 1 and i not in positioned]
    decodes = [
        _plan_decode(block_table, cu, lens, batch, block_size, dtype)
        for batch in _decode_batches(decode_seqs, lens)
    ]
    first_block, run_len = _first_runs(block_table)
    masks: dict[tuple[int, int], torch.Tensor] = {}
    seqs: list[tuple[int, int, Segment, torch.Tensor | None]] = []
    decoded = set(decode_seqs)
    for i, seq_len in enumerate(lens):
        start, end = cu[i], cu[i + 1]
        if i in decoded or start == end:
            continue
        q_len, kv_len, mask = end - start, seq_len, None
        if i in positioned:
            assert positions is not None  # only q_positions makes a sequence positioned
            rows = positions[start:end]
            kv_len = max(rows) + 1  # keys past the last position are seen by no row
            keys = torch.arange(kv_len, device=device)
            query = torch.tensor(rows, device=device)
            mask = _additive(keys[None, :] <= query[:, None], dtype)
        elif q_len < kv_len:
            if (q_len, kv_len) not in masks:
                visible = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
                masks[q_len, kv_len] = _additive(visible.tril(kv_len - q_len), dtype)
            mask = masks[q_len, kv_len]
        n_blocks = -(-kv_len // block_size)
        blocks: slice | torch.Tensor = slice(first_block[i], first_block[i] + n_blocks)
        if run_len[i] < n_blocks:
            blocks = block_table[i, :n_blocks].long()
        seqs.append((start, end, (blocks, kv_len), mask))
    return AttentionPlan(seqs, decodes, positions)


def _positioned_seqs(positions: list[int], cu: list[int], lens: list[int]) -> set[int]:
    """The sequences whose query rows are not their last ``q_len`` positions in order.

    Raises :class:`InvalidInputError` for a position outside ``[0, seq_len)``.
    """
    if len(positions) != cu[-1]:
        raise InvalidInputError(
            f"q_positions must have one entry per query row ({cu[-1]}); got {len(positions)}.",
            param="q_positions",
        )
    positioned = set()
    for i, seq_len in enumerate(lens):
        rows = positions[cu[i] : cu[i + 1]]
        if not rows:
            continue
        if min(rows) < 0 or max(rows) >= seq_len:
            raise InvalidInputError(
                f"q_positions of sequence {i} must lie in [0, {seq_len}); "
                f"got {min(rows)} .. {max(rows)}.",
                param="q_positions",
            )
        if rows != list(range(seq_len - len(rows), seq_len)):
            positioned.add(i)
    return positioned


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # SDPA turns a boolean mask into this 0 / -inf float mask on every call; build it once.
    zeros = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return zeros.masked_fill_(~visible, float("-inf"))


def _decode_batches(seqs: list[int], lens: list[int]) -> list[list[int]]:
    """``seqs`` by decreasing length, cut where a sequence is not longer than half the
    longest of its batch."""
    batches: list[list[int]] = []
    for i in sorted(seqs, key=lambda i: -lens[i]):
        if batches and 2 * lens[i] > lens[batches[-1][0]]:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def _plan_decode(
    block_table: torch.Tensor,
    cu: list[int],
    lens: list[int],
    seqs: list[int],
    block_size: int,
    dtype: torch.dtype,
) -> DecodeBatch:
    device = block_table.device
    seq_lens = [lens[i] for i in seqs]
    n_blocks = [-(-length // block_size) for length in seq_lens]
    max_blocks, tokens = max(n_blocks), max(seq_lens)
    idx = torch.tensor(seqs, device=device)
    table = block_table[idx, :max_blocks].long()
    needed = torch.tensor(n_blocks, device=device)
    columns = torch.arange(max_blocks, device=device)
    table = torch.where(columns < needed[:, None], table, table[:, :1])
    past_end = mask = None
    if any(length != tokens for length in seq_lens):
        positions = torch.arange(tokens, device=device)
        visible = positions < torch.tensor(seq_lens, device=device)[:, None]
        row, slot = (~visible).nonzero().unbind(1)
        # Flat slots of the gather, [batch * max_blocks * block_size] before it is cut to tokens.
        past_end = row * (max_blocks * block_size) + slot
        mask = _additive(visible.view(len(seqs), 1, 1, tokens), dtype)
    rows = torch.tensor([cu[i] for i in seqs], device=device)
    return DecodeBatch(rows, table.flatten(), tokens, past_end, mask)


def _first_runs(block_table: torch.Tensor) -> tuple[list[int], list[int]]:
    """Per sequence: its first block id and how many of its ids, from the first, are
    consecutive (``first, first + 1, ...``)."""
    num_seqs, width = block_table.shape
    if width == 0:
        return [0] * num_seqs, [0] * num_seqs
    first = block_table[:, 0].tolist()
    if width == 1:
        return first, [1] * num_seqs
    breaks = block_table[:, 1:] - block_table[:, :-1] != 1
    breaks = torch.cat([breaks, torch.ones_like(breaks[:, :1])], dim=1)
    return first, (breaks.to(torch.uint8).argmax(dim=1) + 1).tolist()


def to_list(x: IntSeq) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)
