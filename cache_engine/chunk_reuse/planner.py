"""Which tokens of an opted-in prompt are copied from elsewhere, and which are computed.

After the exact prefix hit, each chunk span found in the :class:`ChunkIndex` is *reused*:
its K/V is copied from where it was recorded to its new positions (keys re-rotated by the
position delta), except for the tokens the strategy recomputes. Everything else after the
prefix (chunks not found, recomputed tokens, the question, the prompt's last token) is
*computed*, in one forward with explicit positions::

    prompt   | exact prefix (hit) | chunk A (found)   | chunk B (not found) | question |
    computed |                    | k first  ·······  | ███████████████████ | ████████ |
    copied   |                    |          ████████ |                     |          |

Pure Python over small integers; the copy itself runs in the model runner
(:mod:`~ragkv.cache_engine.chunk_reuse.placement`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ragkv.cache_engine.chunk_reuse.config import MIN_CHUNK_TOKENS, BlendConfig
from ragkv.cache_engine.chunk_reuse.index import ChunkLocation


@dataclass(slots=True)
class BlendPlan:
    """One blended prefill: what is copied (and pinned until then) and what is computed."""

    positions: list[int]  # computed this step, ascending; the last is the prompt's last
    src_slots: list[int] = field(default_factory=list)  # copied from these KV slots ...
    dst_positions: list[int] = field(default_factory=list)  # ... to these positions
    deltas: list[int] = field(default_factory=list)  # per copied token: new - old position
    pinned: list[int] = field(default_factory=list)  # source blocks held until the copy ran
    reused_chunk_tokens: int = 0  # tokens of the chunks found (copied + recomputed)
    placed: bool = False  # the runner copied the K/V

    @property
    def exact_until(self) -> int | None:
        """The first copied position: K/V before it is exact (prefix, computed tokens that
        saw only exact K/V), from it on approximate. None when nothing is copied."""
        return min(self.dst_positions) if self.dst_positions else None

    @property
    def reused_tokens(self) -> int:
        """Tokens whose K/V was copied and kept (what ``reused_nonprefix_tokens`` reports)."""
        return len(self.dst_positions)


def plan_blend(
    token_ids: Sequence[int],
    spans: Sequence[tuple[int, int]],
    num_computed: int,
    config: BlendConfig,
    lookup: Callable[[Sequence[int]], ChunkLocation | None],
    block_size: int,
) -> BlendPlan | None:
    """The blended prefill of ``token_ids`` after an exact prefix of ``num_computed`` tokens;
    None when no chunk after the prefix is found (the request then runs exactly)."""
    last = len(token_ids) - 1
    plan = BlendPlan(positions=[])
    for start, end in spans:
        if start < num_computed or end - start < MIN_CHUNK_TOKENS:
            continue
        location = lookup(token_ids[start:end])
        if location is None:
            continue
        plan.reused_chunk_tokens += end - start
        keep_from = start + config.recomputed(end - start)
        keep_to = min(end, last)  # the prompt's last token is always computed (logits)
        if keep_from >= keep_to:
            continue
        plan.src_slots += location.slots(block_size, keep_from - start, keep_to - start)
        plan.dst_positions += range(keep_from, keep_to)
        plan.deltas += [start - location.start] * (keep_to - keep_from)
        plan.pinned += location.block_ids
    if not plan.reused_chunk_tokens:
        return None
    copied = set(plan.dst_positions)
    plan.positions = [p for p in range(num_computed, last + 1) if p not in copied]
    plan.pinned = list(dict.fromkeys(plan.pinned))
    return plan
