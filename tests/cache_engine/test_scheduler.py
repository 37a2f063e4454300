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
