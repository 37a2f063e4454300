"""The engine survives failures: a step that raises, a caller that vanished, close races."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from support import ids

from ragkv.cache_engine import Engine, SamplingParams
from ragkv.cache_engine.engine_core import MAX_CONSECUTIVE_STEP_FAILURES
from ragkv.errors import EngineClosedError, EngineUnhealthyError, InvalidInputError

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
N = 70  # prompt tokens


def test_a_failed_step_fails_its_requests_and_never_serves_unwritten_blocks(engine, llama_dir):
    real_execute = engine.runner.execute
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated out of memory")
        return real_execute(batch)

    engine.runner.execute = flaky
    with pytest.raises(RuntimeError, match="simulated"):
        engine.generate(ids(1, N), PARAMS)
    retry = engine.generate(ids(1, N), PARAMS)
    # The failed step had registered the prompt's full blocks before computing them.
    assert retry.usage.cached_tokens == 0
    with Engine.from_pretrained(llama_dir, device="cpu", kv_cache_tokens=2048) as fresh:
        assert retry.token_ids == fresh.generate(ids(1, N), PARAMS).token_ids
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks


def test_a_caller_whose_event_loop_closed_does_not_stop_the_engine(engine):
    async def give_up():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(
                engine.agenerate(ids(2, 200), SamplingParams(max_tokens=400, ignore_eos=True)),
                0.05,
            )

    asyncio.run(give_up())  # the loop is closed while the engine may still emit events
    time.sleep(0.2)
    assert engine.core._thread is not None and engine.core._thread.is_alive()
    out = engine.generate(ids(3, N), PARAMS)
    assert out.usage.completion_tokens == 6


def test_close_racing_a_submission_raises_instead_of_hanging(engine, monkeypatch):
    make = engine._make_request

    def validate_then_close(*args, **kwargs):
        request = make(*args, **kwargs)
        engine.close()  # close() wins the race after validation, before the submission
        return request

    monkeypatch.setattr(engine, "_make_request", validate_then_close)
    with pytest.raises(EngineClosedError):
        engine.generate(ids(4, N), PARAMS)


def test_close_fails_requests_in_flight(llama_dir):
    engine = Engine.from_pretrained(llama_dir, device="cpu", kv_cache_tokens=2048)
    stream = engine.stream(ids(5, N), SamplingParams(max_tokens=500, ignore_eos=True))
    next(stream)
    engine.close()
    with pytest.raises(EngineClosedError):
        for _ in stream:
            pass


# -- no request can hurt another (Invariant 9) --------------------------------------------

TIMEOUT_S = 20  # generous: a hang shows up as a timeout, never as a slow pass


def in_thread(fn):
    """Run ``fn`` in a worker thread; ``result()`` re-raises its error, or times out."""
    pool = ThreadPoolExecutor(1)
    future = pool.submit(fn)
    pool.shutdown(wait=False)
    return future


def test_a_bad_salt_fails_its_caller_and_a_concurrent_request_is_served_exactly(engine, llama_dir):
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    good = in_thread(lambda: engine.generate(ids(6, N), params))
    with pytest.raises(InvalidInputError) as info:
        engine.generate("x", SamplingParams(max_tokens=1), cache_salt="\ud800")
    assert info.value.param == "cache_salt"
    out = good.result(timeout=TIMEOUT_S)
    with Engine.from_pretrained(llama_dir, device="cpu", kv_cache_tokens=2048) as fresh:
        assert out.token_ids == fresh.generate(ids(6, N), params).token_ids
    assert engine.health().ok


def test_a_failure_in_one_waiting_requests_hashing_fails_only_that_request(engine, monkeypatch):
    doomed = ids(7, N)
    real = engine.kv.get_computed_blocks

    def poisoned(request, **kwargs):
        if request.prompt_token_ids == doomed:
            raise RuntimeError("simulated hashing fault")
        return real(request, **kwargs)

    monkeypatch.setattr(engine.kv, "get_computed_blocks", poisoned)
    bad = in_thread(lambda: engine.generate(doomed, PARAMS))
    good = [in_thread(lambda s=s: engine.generate(ids(s, N), PARAMS)) for s in (8, 9)]
    with pytest.raises(RuntimeError, match="simulated hashing fault"):
        bad.result(timeout=TIMEOUT_S)
    assert all(g.result(timeout=TIMEOUT_S).usage.completion_tokens == 6 for g in good)
    health = engine.health()
    assert health.ok and health.consecutive_failures == 0
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks


def test_a_failure_in_one_running_requests_detokenizer_fails_only_that_request(engine, monkeypatch):
    make = engine._make_request

    def poison_one(prompt, params, *args):
        state = make(prompt, params, *args)
        if prompt == ids(10, N):

            def broken(token_id, engine_reason=None):
                raise RuntimeError("simulated detokenizer fault")

            state.detokenizer.add = broken
        return state

    monkeypatch.setattr(engine, "_make_request", poison_one)
    long = SamplingParams(max_tokens=12, ignore_eos=True)
    good = in_thread(lambda: engine.generate(ids(11, N), long))
    with pytest.raises(RuntimeError, match="simulated detokenizer fault"):
        in_thread(lambda: engine.generate(ids(10, N), PARAMS)).result(timeout=TIMEOUT_S)
    assert good.result(timeout=TIMEOUT_S).usage.completion_tokens == 12
    assert engine.health().ok


def test_a_forward_that_always_fails_trips_the_engine_instead_of_hanging(llama_dir, monkeypatch):
    # One request a step, so each failing step fails one request and the rest stay queued.
    engine = Engine.from_pretrained(llama_dir, device="cpu", kv_cache_tokens=2048, max_num_seqs=1)
    all_queued = threading.Event()
    submit, submitted = engine._submit, []

    def counting_submit(request, sink):
        submit(request, sink)
        submitted.append(request)
        if len(submitted) == 5:
            all_queued.set()

    def broken(batch):
        all_queued.wait(TIMEOUT_S)
        raise RuntimeError("simulated device fault")

    monkeypatch.setattr(engine, "_submit", counting_submit)
    engine.runner.execute = broken
    with engine:
        calls = [in_thread(lambda s=s: engine.generate(ids(s, N), PARAMS)) for s in range(12, 17)]
        errors = []
        for call in calls:
            with pytest.raises((RuntimeError, EngineUnhealthyError)) as info:
                call.result(timeout=TIMEOUT_S)
            errors.append(type(info.value))
        assert errors.count(RuntimeError) == MAX_CONSECUTIVE_STEP_FAILURES
        assert errors.count(EngineUnhealthyError) == 5 - MAX_CONSECUTIVE_STEP_FAILURES
        health = engine.health()
        assert not health.ok and health.thread_alive
        assert health.consecutive_failures == MAX_CONSECUTIVE_STEP_FAILURES
        assert "simulated device fault" in health.reason
        with pytest.raises(EngineUnhealthyError, match="create a new Engine"):
            engine.generate(ids(21, N), PARAMS)


def test_health_of_a_working_and_a_closed_engine(llama_dir):
    engine = Engine.from_pretrained(llama_dir, device="cpu", kv_cache_tokens=2048)
    fresh = engine.health()
    assert fresh.ok and fresh.last_step_age_s is None and not fresh.busy
    assert not fresh.thread_alive  # started by the first request, or by start()
    engine.start()
    engine.start()  # idempotent
    assert engine.health().thread_alive and engine.health().ok
    engine.generate(ids(22, N), PARAMS)
    served = engine.health()
    assert served.ok and served.thread_alive and served.last_step_age_s is not None
    assert served.consecutive_failures == 0 and served.reason is None
    engine.close()
    closed = engine.health()
    assert not closed.ok and not closed.thread_alive and "closed" in closed.reason


class _Fatal(BaseException):
    """Not an Exception: nothing in the engine may catch and survive it."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_stepping_thread_fails_its_requests_and_reports_unhealthy(engine, monkeypatch):
    def fatal():
        raise _Fatal("simulated interpreter shutdown")

    monkeypatch.setattr(engine.core, "step", fatal)
    with pytest.raises(EngineUnhealthyError, match="stepping thread died"):
        in_thread(lambda: engine.generate(ids(23, N), PARAMS)).result(timeout=TIMEOUT_S)
    engine.core._thread.join(timeout=TIMEOUT_S)
    health = engine.health()
    assert not health.ok and not health.thread_alive and "died" in health.reason
    with pytest.raises(EngineUnhealthyError):
        engine.generate(ids(24, N), PARAMS)
