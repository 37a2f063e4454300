"""AttentionPlan: what one step's attention metadata implies for the torch path.

Run detection (which blocks of a sequence are consecutive, read as views), index tensors
for the batched decode gather, and the additive causal or position masks depend only on the
step's metadata, never on a layer's K/V: :func:`plan_attention` builds them once per step
and every layer's :func:`~ragkv.kernels.paged_attention_torch.paged_attention_torch`
reads them. The attention semantics (bottom-right causal, ``q_positions``) are described in
:mod:`ragkv.kernels.paged_attention`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ragkv.errors import InvalidInputError

IntSeq = torch.Tensor | Sequence[int]
_MAX_RUNS = 8  # per prefill; more runs are gathered (see _split)

Segment = tuple[slice | torch.Tensor, int]  # blocks (a range, or ids to gather), tokens used


@dataclass(slots=True)
class DecodeBatch:
    """Index tensors of one padded decode gather (see :func:`~ragkv.kernels.paged_attention_torch.decode_gathered`)."""

    rows: torch.Tensor  # [batch] query rows of the decode sequences
    blocks: torch.Tensor  # [batch * max_blocks] block ids, padding -> the row's first block
    past_end: torch.Tensor | None  # flat gathered token slots past each sequence's length
    mask: torch.Tensor | None  # additive [batch, 1, 1, max_blocks * block_size]


@dataclass(slots=True)
class AttentionPlan:
    """What one step's metadata implies for the torch path, identical for every layer.

    Building it (run detection, index tensors, causal masks) costs more than a layer's
    gathers, and a ``[q_len, kv_len]`` mask rebuilt per layer more than the SDPA it serves,
    so a step builds one plan and hands it to all its layers. It describes the table it was
    built from: a table edited afterwards needs a new plan.
    """

    # Per sequence not in ``decode``: (q start, q end, prefix, tail, mask of the tail or None).
    seqs: list[tuple[int, int, list[Segment], Segment, torch.Tensor | None]]
    decode: DecodeBatch | None
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

    With ``q_positions``, a sequence whose rows are exactly its last ``q_len`` positions in
    order is planned as without them (same segments, same results); any other sequence gets
    a position mask over its keys ``0 .. max(position)`` (see :func:`_plan_positioned`).
    """
    cu, lens = to_list(cu_seqlens_q), to_list(seq_lens)
    positions: list[int] | None = None
    positioned: set[int] = set()
    if q_positions is not None:
        positions = q_positions if isinstance(q_positions, list) else to_list(q_positions)
        positioned = _positioned_seqs(positions, cu, lens)
    device = block_table.device
    n_blocks = [-(-length // block_size) for length in lens]
    first_block, consecutive = _consecutive_runs(block_table, n_blocks)
    gathered_decode = [
        i
        for i in range(len(lens))
        if cu[i + 1] - cu[i] == 1 and not consecutive[i] and i not in positioned
    ]
    decode = None
    if len(gathered_decode) > 1:
        decode = _plan_decode(block_table, cu, lens, n_blocks, gathered_decode, block_size, dtype)
    batched = set(gathered_decode) if decode is not None else set()
    masks: dict[tuple[int, int], torch.Tensor] = {}
    seqs: list[tuple[int, int, list[Segment], Segment, torch.Tensor | None]] = []
    prefix: list[Segment]
    tail: Segment
    mask: torch.Tensor | None
    for i, seq_len in enumerate(lens):
        start, end = cu[i], cu[i + 1]
        if i in batched or start == end:
            continue
        if i in positioned:
            assert positions is not None  # only q_positions makes a sequence positioned
            rows = positions[start:end]
            seqs.append((start, end, *_plan_positioned(block_table[i], rows, block_size, dtype)))
            continue
        q_len, prefix = end - start, []
        if consecutive[i]:
            tail = (slice(first_block[i], first_block[i] + n_blocks[i]), seq_len)
        else:
            prefix, tail = _split(
                block_table[i, : n_blocks[i]], seq_len, seq_len - q_len, block_size
            )
        tail_len, mask = tail[1], None
        if 1 < q_len < tail_len:
            if (q_len, tail_len) not in masks:
                visible = torch.ones(q_len, tail_len, dtype=torch.bool, device=device)
                masks[q_len, tail_len] = _additive(visible.tril(tail_len - q_len), dtype)
            mask = masks[q_len, tail_len]
        seqs.append((start, end, prefix, tail, mask))
    return AttentionPlan(seqs, decode, positions)


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


def _plan_positioned(
    table_row: torch.Tensor, rows: list[int], block_size: int, dtype: torch.dtype
) -> tuple[list[Segment], Segment, torch.Tensor]:
    """Prefix, tail and position mask of a sequence whose queries sit at ``rows``.

    Keys past the last position are seen by no row and are not read. Keys before the first
    position are seen by every row: they form the unmasked prefix of runs, as in
    :func:`_split`, and the tail starts at a run that holds key ``min(rows)``, which every
    row sees, so no row of the masked tail is empty.
    """
    kv_len = max(rows) + 1
    blocks = table_row[: -(-kv_len // block_size)]
    prefix, tail = _split(blocks, kv_len, min(rows), block_size)
    tail_start = kv_len - tail[1]
    keys = torch.arange(tail_start, kv_len, device=table_row.device)
    query = torch.tensor(rows, device=table_row.device)
    return prefix, tail, _additive(keys[None, :] <= query[:, None], dtype)


def _split(
    blocks: torch.Tensor, kv_len: int, context: int, block_size: int
) -> tuple[list[Segment], Segment]:
    """Split a prefill's keys ``0 .. kv_len - 1`` into a prefix of consecutive block runs
    read as views, and a tail from the first run that reaches key ``context``
    (``seq_len - q_len`` for the last ``q_len`` positions).

    Every query sees all keys before ``context`` and key ``context`` itself, so the prefix
    needs no mask and no row of the tail is fully masked (its logsumexp stays finite). A
    table of many short runs (more than ``_MAX_RUNS``) is gathered whole instead: one call
    per run would cost more than the copy.
    """
    ids = blocks.tolist()
    starts = [j for j in range(len(ids)) if j == 0 or ids[j] != ids[j - 1] + 1]
    prefix: list[Segment] = []
    for j, next_j in itertools.pairwise([*starts, len(ids)]):
        if next_j * block_size > context or len(starts) > _MAX_RUNS:
            tail = (
                blocks[j:].long() if len(prefix) + 1 < len(starts) else slice(ids[j], ids[-1] + 1)
            )
            return prefix, (tail, kv_len - j * block_size)
        prefix.append((slice(ids[j], ids[j] + next_j - j), (next_j - j) * block_size))
    raise AssertionError("unreachable: the last run holds the last query's key")


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # SDPA turns a boolean mask into this 0 / -inf float mask on every call; build it once.
    zeros = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return zeros.masked_fill_(~visible, float("-inf"))


def _plan_decode(
    block_table: torch.Tensor,
    cu: list[int],
    lens: list[int],
    n_blocks: list[int],
    seqs: list[int],
    block_size: int,
    dtype: torch.dtype,
) -> DecodeBatch:
    device = block_table.device
    max_blocks = max(n_blocks[i] for i in seqs)
    idx = torch.tensor(seqs, device=device)
    table = block_table[idx, :max_blocks].long()
    needed = torch.tensor([n_blocks[i] for i in seqs], device=device)
    columns = torch.arange(max_blocks, device=device)
    table = torch.where(columns < needed[:, None], table, table[:, :1])
    past_end = mask = None
    padded = max_blocks * block_size
    if any(lens[i] != padded for i in seqs):
        seq_lens = torch.tensor([lens[i] for i in seqs], device=device)
        positions = torch.arange(padded, device=device)
        visible = positions < seq_lens[:, None]
        past_end = (~visible).flatten().nonzero().flatten()
        mask = _additive(visible.view(len(seqs), 1, 1, padded), dtype)
    rows = torch.tensor([cu[i] for i in seqs], device=device)
    return DecodeBatch(rows, table.flatten(), past_end, mask)


def _consecutive_runs(
    block_table: torch.Tensor, n_blocks: list[int]
) -> tuple[list[int], list[bool]]:
    """Per sequence: its first block id and whether its ``n_blocks`` ids are consecutive."""
    first = block_table[:, 0].tolist() if block_table.shape[1] else [0] * len(n_blocks)
    if block_table.shape[1] <= 1:
        return first, [True] * len(n_blocks)
    breaks = block_table[:, 1:] - block_table[:, :-1] != 1
    breaks = torch.cat([breaks, torch.ones_like(breaks[:, :1])], dim=1)
    run_len = (breaks.to(torch.uint8).argmax(dim=1) + 1).tolist()
    return first, [run >= n for run, n in zip(run_len, n_blocks, strict=True)]


def to_list(x: IntSeq) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)
