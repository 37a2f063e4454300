"""What one engine step computes: the scheduler's records, read by the runner, the output
processor and the KV tiers.

A *slice* is a run of one request's tokens computed in a step (a chunk of a chunked
prefill, or one decode token); "chunk" means a retrieved passage elsewhere in ragkv.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ragkv.cache_engine.request import Request


@dataclass(slots=True)
class ScheduledSlice:
    """Tokens ``[start, start + num_tokens)`` of ``request`` are computed this step.

    ``positions`` (opt-in, for chunk reuse): the explicit positions of the ``num_tokens``
    tokens computed this step, in any order, each below ``end``; every other position below
    ``end`` must already hold K/V. The sequence is ``end`` tokens long after the step, and a
    slice that samples must compute position ``end - 1``. ``None``: positions
    ``start .. end - 1``.
    """

    request: Request
    start: int
    num_tokens: int
    block_table: list[int]  # the request's blocks in token order (the manager's live list)
    positions: list[int] | None = None

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """True when this slice reaches the end of the request: the step samples a token."""
        return self.end == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    """One step: the slices to compute, requests preempted and requests failed while
    scheduling (finished and freed already)."""

    slices: list[ScheduledSlice] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    failed: list[tuple[Request, Exception]] = field(default_factory=list)  # finished, freed
