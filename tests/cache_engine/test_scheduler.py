"""Scheduler: a request whose own scheduling work raises is taken out alone."""

from __future__ import annotations

import pytest

from ragkv.cache_engine import KVCacheManager, SamplingParams
from ragkv.cache_engine.config import DEFAULTS
from ragkv.cache_engine.request import Request, RequestStatus
from ragkv.cache_engine.scheduler import Scheduler
from ragkv.errors import CacheCapacityError, PromptTooLongError


class PoisonedManager(KVCacheManager):
    """Hashing raises for one request id, as a bad input would: from its ``fail_from``-th
    lookup on (the first is at arrival, :meth:`KVCacheManager.note_demand`)."""

    poisoned = "bad"

    def __init__(self, *args, fail_from: int = 2, **kwargs):
        super().__init__(*args, **kwargs)
        self.fail_from = fail_from
        self.lookups = 0

    def get_computed_blocks(self, request, *, record=True):
        if request.request_id == self.poisoned:
            self.lookups += 1
            if self.lookups >= self.fail_from:
                raise RuntimeError("simulated hashing fault")
        return super().get_computed_blocks(request, record=record)


def add_around_the_poisoned(scheduler: Scheduler, n: int, *, max_tokens: int) -> list[Request]:
    """Requests "a", "bad" (the poisoned id) and "c" of ``n`` prompt tokens, added in order."""
    requests = [
        Request(rid, list(range(i, i + n)), SamplingParams(max_tokens=max_tokens))
        for i, rid in enumerate(["a", "bad", "c"])
    ]
    for request in requests:
        scheduler.add(request)
    return requests


@pytest.mark.parametrize("policy", ["fcfs", "longest-prefix"])
def test_a_request_failing_in_its_own_hashing_is_reported_and_the_rest_are_scheduled(policy):
    kv = PoisonedManager(num_blocks=32, block_size=4)
    scheduler = Scheduler(kv, DEFAULTS.replace(schedule_policy=policy))
    requests = add_around_the_poisoned(scheduler, 10, max_tokens=2)
    out = scheduler.schedule()
    assert [(r.request_id, str(e)) for r, e in out.failed] == [("bad", "simulated hashing fault")]
    assert {c.request.request_id for c in out.slices} == {"a", "c"}
    assert requests[1].status is RequestStatus.FINISHED
    assert requests[1] not in scheduler.waiting and requests[1] not in scheduler.running
    assert kv.num_free_blocks == 32 - 2 * 3  # only a and c hold blocks


def test_a_request_failing_in_its_own_hashing_on_arrival_is_refused_and_not_queued():
    kv = PoisonedManager(num_blocks=32, block_size=4, fail_from=1)
    scheduler = Scheduler(kv)
    bad = Request("bad", list(range(10)), SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="simulated hashing fault"):
        scheduler.add(bad)
    assert not scheduler.waiting and not scheduler.has_unfinished()
    good = Request("a", list(range(10)), SamplingParams(max_tokens=2))
    scheduler.add(good)
    assert [c.request.request_id for c in scheduler.schedule().slices] == ["a"]


class PoisonedAllocation(KVCacheManager):
    """Allocation (hashing newly full blocks) raises for one request id once it decodes."""

    poisoned = "bad"

    def allocate_slots(self, request, num_new_tokens, computed_blocks=None, **kw):
        if request.request_id == self.poisoned and request.num_computed_tokens:
            raise RuntimeError("simulated allocation fault")
        return super().allocate_slots(request, num_new_tokens, computed_blocks, **kw)


def test_a_running_request_failing_in_its_own_allocation_is_reported_alone():
    kv = PoisonedAllocation(num_blocks=32, block_size=4)
    scheduler = Scheduler(kv)
    requests = add_around_the_poisoned(scheduler, 7, max_tokens=4)
    first = scheduler.schedule()
    assert len(first.slices) == 3 and not first.failed
    for chunk in first.slices:  # the step ran: K/V written, one token sampled each
        chunk.request.num_computed_tokens = chunk.end
        chunk.request.token_ids.append(1)
    second = scheduler.schedule()
    assert [r.request_id for r, _ in second.failed] == ["bad"]
    assert [c.request.request_id for c in second.slices] == ["a", "c"]
    assert scheduler.running == [requests[0], requests[2]]


# -- the scheduling algorithm, no model: a step is schedule() then update() --------------


def make(rid: str, n: int, *, first: int = 100, max_tokens: int = 4, **kwargs) -> Request:
    """A request of ``n`` prompt tokens counting up from ``first``."""
    return Request(
        rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens), **kwargs
    )


def run_step(scheduler: Scheduler, token: int = 7):
    """Schedule, pretend the model ran, sample ``token`` for every slice that samples."""
    out = scheduler.schedule()
    scheduler.update(out, [token] * sum(c.samples for c in out.slices))
    return out


def slices(out) -> list[tuple[str, int, int]]:
    return [(c.request.request_id, c.start, c.num_tokens) for c in out.slices]


def test_the_token_budget_chunks_the_prefill_that_does_not_fit():
    scheduler = Scheduler(KVCacheManager(64, 4), DEFAULTS.replace(max_num_batched_tokens=16))
    for i, rid in enumerate("abc"):
        scheduler.add(make(rid, 10, first=100 * (i + 1)))
    out = scheduler.schedule()
    assert slices(out) == [("a", 0, 10), ("b", 0, 6)]  # c waits: the budget is spent
    assert [c.samples for c in out.slices] == [True, False]
    scheduler.update(out, [7])
    out = run_step(scheduler)
    # Running requests first (a decodes, b finishes its prefill), then c with what is left.
    assert slices(out) == [("a", 10, 1), ("b", 6, 4), ("c", 0, 10)]


def test_a_long_prompt_is_prefilled_in_budget_sized_chunks_then_decodes():
    scheduler = Scheduler(KVCacheManager(64, 4), DEFAULTS.replace(max_num_batched_tokens=16))
    request = make("long", 40, max_tokens=2)
    scheduler.add(request)
    steps = [slices(run_step(scheduler)) for _ in range(4)]
    assert steps == [
        [("long", 0, 16)],
        [("long", 16, 16)],
        [("long", 32, 8)],  # reaches the end of the prompt: samples the first token
        [("long", 40, 1)],  # decodes the second and last
    ]
    assert request.output_token_ids == [7, 7] and request.finish_reason == "length"
    assert not scheduler.has_unfinished()


def test_a_full_pool_preempts_the_youngest_running_request_which_is_recomputed():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    scheduler = Scheduler(kv)
    old, young = (
        make("old", 8, first=100, max_tokens=12),
        make("young", 8, first=200, max_tokens=12),
    )
    scheduler.add(old)
    scheduler.add(young)
    run_step(scheduler)  # both prefilled: 2 blocks each, 2 left
    for _ in range(20):
        preempted = run_step(scheduler).preempted
        if preempted:
            break
    assert preempted == [young] and young.num_preemptions == 1 and old.num_preemptions == 0
    assert scheduler.running == [old] and scheduler.waiting[0] is young
    assert young.num_computed_tokens == 0  # recomputed, not swapped
    generated = young.output_token_ids
    for _ in range(40):  # old runs to its end, then young is admitted again
        out = scheduler.schedule()
        again = [c for c in out.slices if c.request is young]
        if again:
            break
        scheduler.update(out, [7] * sum(c.samples for c in out.slices))
    # Recomputed from its longest cached prefix up to the end, keeping what it generated.
    [chunk] = again
    assert chunk.start % kv.block_size == 0 and chunk.end == young.num_tokens and chunk.samples
    assert young.output_token_ids == generated and old.finished


def test_longest_prefix_admits_the_request_with_the_longest_cached_prefix_first():
    shared = list(range(300, 316))  # four full blocks of 4

    def admitted_first(policy: str) -> str:
        kv = KVCacheManager(num_blocks=64, block_size=4)
        scheduler = Scheduler(kv, DEFAULTS.replace(schedule_policy=policy, max_num_seqs=1))
        warm = Request("warm", shared + [1], SamplingParams(max_tokens=1))
        scheduler.add(warm)
        run_step(scheduler)  # finishes at once; its blocks stay cached
        scheduler.add(make("cold", 17, first=500))  # arrived first, nothing cached
        scheduler.add(Request("hot", shared + [2], SamplingParams(max_tokens=4)))
        out = scheduler.schedule()
        return out.slices[0].request.request_id

    assert admitted_first("fcfs") == "cold"
    assert admitted_first("longest-prefix") == "hot"


def test_a_request_that_can_never_fit_the_pool_is_refused_up_front():
    scheduler = Scheduler(KVCacheManager(num_blocks=4, block_size=4))
    with pytest.raises(PromptTooLongError, match="whole pool"):
        scheduler.add(make("huge", 17))  # 5 blocks of prompt alone
    with pytest.raises(CacheCapacityError) as info:
        scheduler.add(make("greedy", 8, max_tokens=20))  # 7 blocks at its longest
    assert info.value.param == "max_tokens"
    assert not scheduler.has_unfinished()


def test_update_finishes_on_a_stop_token_then_on_max_tokens_then_on_the_context():
    scheduler = Scheduler(KVCacheManager(64, 4), max_model_len=12)
    stops = make("stops", 4, max_tokens=8, stop_token_ids=frozenset({9}))
    short = make("short", 4, first=200, max_tokens=1)
    context = make("context", 10, first=300, max_tokens=8)
    for request in (stops, short, context):
        scheduler.add(request)
    out = scheduler.schedule()
    assert scheduler.update(out, [9, 9, 5]) == [stops, short, context]
    assert (stops.finish_reason, short.finish_reason) == ("stop", "length")
    assert not context.finished
    run_step(scheduler, token=5)
    assert context.finish_reason == "length" and context.num_tokens == 12
    assert kv_free(scheduler) == 64


def kv_free(scheduler: Scheduler) -> int:
    return scheduler.kv.num_free_blocks


def _request(rid: str, n: int, salt: bytes | None = None, start: int = 0) -> Request:
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=1), salt)


def test_waiting_requests_of_several_tenants_are_admitted_round_robin():
    kv = KVCacheManager(num_blocks=256, block_size=4)
    scheduler = Scheduler(kv, DEFAULTS.replace(max_num_seqs=3))
    for i in range(5):  # tenant B floods first
        scheduler.add(_request(f"b{i}", 8, b"B", start=100 * i))
    scheduler.add(_request("a0", 8, b"A", start=999))
    scheduler.add(_request("a1", 8, b"A", start=1999))
    out = scheduler.schedule()
    assert [c.request.request_id for c in out.slices] == ["b0", "a0", "b1"]
    # One tenant alone keeps its arrival order.
    solo = Scheduler(KVCacheManager(num_blocks=256, block_size=4), DEFAULTS.replace(max_num_seqs=2))
    for i in range(3):
        solo.add(_request(f"s{i}", 8, b"S", start=100 * i))
    assert [c.request.request_id for c in solo.schedule().slices] == ["s0", "s1"]


def test_a_head_that_does_not_fit_is_passed_by_smaller_requests_a_bounded_number_of_times():
    from ragkv.cache_engine.scheduler import MAX_TIMES_SKIPPED

    kv = KVCacheManager(num_blocks=8, block_size=4)  # 32 tokens in all
    config = DEFAULTS.replace(max_num_batched_tokens=64)
    scheduler = Scheduler(kv, config)
    hog = _request("hog", 24, start=0)  # 6 blocks, then a 7th as it decodes
    hog.params = SamplingParams(max_tokens=4)
    scheduler.add(hog)
    out = scheduler.schedule()
    assert [c.request.request_id for c in out.slices] == ["hog"]
    scheduler.update(out, [7])
    scheduler.add(_request("big", 20, start=500))  # 5 blocks: not while hog runs
    scheduler.add(_request("small", 3, start=900))  # 1 block: fits beside hog
    chunks = scheduler.schedule().slices
    assert [c.request.request_id for c in chunks] == ["hog", "small"]
    assert scheduler.waiting[0].request_id == "big" and scheduler.waiting[0].num_skipped == 1
    # Bounded: once passed MAX_TIMES_SKIPPED times, the head waits and so does everyone.
    scheduler.waiting[0].num_skipped = MAX_TIMES_SKIPPED
    scheduler.add(_request("tiny", 2, start=950))
    assert "tiny" not in [c.request.request_id for c in scheduler.schedule().slices]
