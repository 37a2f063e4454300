"""Scheduler: a request whose own scheduling work raises is taken out alone."""

from __future__ import annotations

import pytest

from ragkv.cache_engine import KVCacheManager, SamplingParams
from ragkv.cache_engine.request import Request, RequestStatus
from ragkv.cache_engine.scheduler import Scheduler


class PoisonedManager(KVCacheManager):
    """Hashing raises for one request id, as a bad input would."""

    poisoned = "bad"

    def get_computed_blocks(self, request, *, record=True):
        if request.request_id == self.poisoned:
            raise RuntimeError("simulated hashing fault")
        return super().get_computed_blocks(request, record=record)


@pytest.mark.parametrize("policy", ["fcfs", "longest-prefix"])
def test_a_request_failing_in_its_own_hashing_is_reported_and_the_rest_are_scheduled(policy):
    kv = PoisonedManager(num_blocks=32, block_size=4)
    scheduler = Scheduler(kv, policy=policy)
    requests = [
        Request(rid, list(range(i, i + 10)), SamplingParams(max_tokens=2))
        for i, rid in enumerate(["a", "bad", "c"])
    ]
    for request in requests:
        scheduler.add(request)
    out = scheduler.schedule()
    assert [(r.request_id, str(e)) for r, e in out.failed] == [("bad", "simulated hashing fault")]
    assert {c.request.request_id for c in out.chunks} == {"a", "c"}
    assert requests[1].status is RequestStatus.FINISHED
    assert requests[1] not in scheduler.waiting and requests[1] not in scheduler.running
    assert kv.num_free_blocks == 32 - 2 * 3  # only a and c hold blocks


class PoisonedAllocation(KVCacheManager):
    """Allocation (hashing newly full blocks) raises for one request id once it decodes."""

    poisoned = "bad"

    def allocate_slots(self, request, num_new_tokens, computed_blocks=None):
        if request.request_id == self.poisoned and request.num_computed_tokens:
            raise RuntimeError("simulated allocation fault")
        return super().allocate_slots(request, num_new_tokens, computed_blocks)


def test_a_running_request_failing_in_its_own_allocation_is_reported_alone():
    kv = PoisonedAllocation(num_blocks=32, block_size=4)
    scheduler = Scheduler(kv)
    requests = [
        Request(rid, list(range(i, i + 7)), SamplingParams(max_tokens=4))
        for i, rid in enumerate(["a", "bad", "c"])
    ]
    for request in requests:
        scheduler.add(request)
    first = scheduler.schedule()
    assert len(first.chunks) == 3 and not first.failed
    for chunk in first.chunks:  # the step ran: K/V written, one token sampled each
        chunk.request.num_computed_tokens = chunk.end
        chunk.request.token_ids.append(1)
    second = scheduler.schedule()
    assert [r.request_id for r, _ in second.failed] == ["bad"]
    assert [c.request.request_id for c in second.chunks] == ["a", "c"]
    assert scheduler.running == [requests[0], requests[2]]
