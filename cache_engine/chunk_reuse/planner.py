"""Which tokens of an opted-in prompt are copied from elsewhere, and which are computed.

After the exact prefix hit, each chunk span found in the :class:`ChunkIndex` is *reused*:
its K/V is copied from where it was recorded to its new positions (keys re-rotated by the
position delta), except for the tokens the strategy recomputes. Everything else after the
prefix (chunks not found, recomputed tokens, the question, the prompt's last token) is
*computed*, in one forward with explicit positions::

    prompt   | exact prefix (hit) | chunk A (found)   | chunk B (not found) | question |
    computed |                    | k first  ·······  | ███████████████████ | ████████ |
    copied   |                    |          ████████ |                     |          |

A chunk that starts inside the exact prefix (a prefix hit that ends mid-chunk) is reused
from the prefix's end on; its first ``k`` count from the chunk's start.

``deviation`` plans copy every found token and recompute as many as ``first-k`` would
(``choose``); the first-k picks stand in until the model runner has measured which
copied tokens deviate most and calls :meth:`BlendPlan.choose_recomputed` (the count is
fixed when the plan is made, so the scheduler's token budget holds either way). With a
``head``, each chunk's first ``head`` tokens are computed outright (never copied) and
deviation chooses only the rest of the budget. A plan whose probe cannot run keeps its
stand-ins (:meth:`BlendPlan.keep_first_k`): head and stand-ins are the first ``budget``
tokens of each chunk, so it becomes the ``first-k`` plan of the same budget.

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
    # deviation: this many copied tokens are still to be chosen for recomputing; until then
    # ``positions`` holds first-k stand-ins, which are also among ``dst_positions``
    choose: int = 0
    probe_fallback: bool = False  # deviation run as first-k: its probe did not fit a step

    @property
    def exact_until(self) -> int | None:
        """The first copied position: K/V before it is exact (prefix, computed tokens that
        saw only exact K/V), from it on approximate. None when nothing is copied."""
        return min(self.dst_positions) if self.dst_positions else None

    @property
    def reused_tokens(self) -> int:
        """Tokens whose K/V was copied and kept (what ``reused_nonprefix_tokens`` reports)."""
        return len(self.dst_positions) - self.choose

    @property
    def start(self) -> int:
        """The first position this plan computes or copies (the exact prefix ends here)."""
        first_copied = self.dst_positions[0] if self.dst_positions else self.positions[0]
        return min(self.positions[0], first_copied)

    def choose_recomputed(self, chosen: Sequence[int]) -> None:
        """Recompute the copied positions ``chosen`` (``choose`` of them, e.g. by deviation)
        instead of the first-k stand-ins; ``positions`` is updated in place (the scheduled
        slice holds the same list) and the chosen tokens leave the copied lists."""
        picked = set(chosen)
        copied = set(self.dst_positions)
        if len(picked) != self.choose or not picked <= copied:
            raise ValueError(
                f"choose_recomputed needs {self.choose} distinct copied positions, "
                f"got {len(chosen)}"
            )
        computed = [p for p in self.positions if p not in copied] + sorted(picked)
        self.positions[:] = sorted(computed)
        kept = [i for i, p in enumerate(self.dst_positions) if p not in picked]
        self.src_slots = [self.src_slots[i] for i in kept]
        self.dst_positions = [self.dst_positions[i] for i in kept]
        self.deltas = [self.deltas[i] for i in kept]
        self.choose = 0

    def keep_first_k(self) -> None:
        """Recompute the first-k stand-ins themselves: the plan becomes the ``first-k`` plan
        of the same per-chunk budget (a deviation plan whose probe cannot run, or has nothing
        to choose between)."""
        copied = set(self.dst_positions)
        self.choose_recomputed([p for p in self.positions if p in copied])


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
    stand_ins: list[int] = []  # deviation: first-k picks until the runner chooses
    for start, end in spans:
        if end <= num_computed or end - start < MIN_CHUNK_TOKENS:
            continue
        location = lookup(token_ids[start:end])
        if location is None:
            continue
        begin = max(start, num_computed)  # a chunk the prefix hit ends inside: its tail
        plan.reused_chunk_tokens += end - begin
        first_k = max(begin, start + config.recomputed(end - start))
        copy_from = first_k
        if config.strategy == "deviation":  # its head (if any) is computed, the rest copied
            copy_from = max(begin, start + config.head_tokens(end - start))
        keep_to = min(end, last)  # the prompt's last token is always computed (logits)
        if copy_from >= keep_to:
            continue
        stand_ins += range(copy_from, min(first_k, keep_to))
        plan.src_slots += location.slots(block_size, copy_from - start, keep_to - start)
        plan.dst_positions += range(copy_from, keep_to)
        plan.deltas += [start - location.start] * (keep_to - copy_from)
        plan.pinned += location.block_ids
    if not plan.reused_chunk_tokens:
        return None
    copied = set(plan.dst_positions).difference(stand_ins)
    plan.positions = [p for p in range(num_computed, last + 1) if p not in copied]
    plan.pinned = list(dict.fromkeys(plan.pinned))
    plan.choose = len(stand_ins)
    return plan
