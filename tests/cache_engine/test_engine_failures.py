"""The engine survives failures: a step that raises, a caller that vanished, close races."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from support import save_tiny_checkpoint

from ragkv.cache_engine import Engine, SamplingParams
from ragkv.errors import EngineClosedError

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=4)


@pytest.fixture
def engine(model_dir):
    with Engine.from_pretrained(model_dir, device="cpu", kv_cache_tokens=2048) as eng:
        yield eng


def ids(seed: int, n: int = 70) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def test_a_failed_step_fails_its_requests_and_never_serves_unwritten_blocks(engine, model_dir):
    real_execute = engine.runner.execute
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated out of memory")
        return real_execute(batch)

    engine.runner.execute = flaky
    with pytest.raises(RuntimeError, match="simulated"):
        engine.generate(ids(1), PARAMS)
    retry = engine.generate(ids(1), PARAMS)
    # The failed step had registered the prompt's full blocks before computing them.
    assert retry.usage.cached_tokens == 0
    with Engine.from_pretrained(model_dir, device="cpu", kv_cache_tokens=2048) as fresh:
        assert retry.token_ids == fresh.generate(ids(1), PARAMS).token_ids
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
    assert engine._thread is not None and engine._thread.is_alive()
    out = engine.generate(ids(3), PARAMS)
    assert out.usage.completion_tokens == 6


def test_close_racing_a_submission_raises_instead_of_hanging(engine, monkeypatch):
    make = engine._make_request

    def validate_then_close(*args, **kwargs):
        request = make(*args, **kwargs)
        engine.close()  # close() wins the race after validation, before the submission
        return request

    monkeypatch.setattr(engine, "_make_request", validate_then_close)
    with pytest.raises(EngineClosedError):
        engine.generate(ids(4), PARAMS)


def test_close_fails_requests_in_flight(model_dir):
    engine = Engine.from_pretrained(model_dir, device="cpu", kv_cache_tokens=2048)
    stream = engine.stream(ids(5), SamplingParams(max_tokens=500, ignore_eos=True))
    next(stream)
    engine.close()
    with pytest.raises(EngineClosedError):
        for _ in stream:
            pass
