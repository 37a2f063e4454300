"""A lane replays the same prompts however its requests are scheduled: the assembler learns
from what it has seen, so assembling out of arrival order would change the prompts and two
lanes (or two runs of one) would not compare like for like."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from transformers import AutoTokenizer

from ragkv.bench import lanes
from ragkv.bench.simulated import SimulatedEngine
from ragkv.bench.workload import synthetic_workload
from ragkv.cache_engine import SamplingParams


class _JitteryEngine(SimulatedEngine):
    """A simulated engine that answers after a random pause and does not report residency
    (as a router does), so only the assembler's learning can change a prompt."""

    knows_residency = False

    def __init__(self, tokenizer, rng: random.Random) -> None:
        super().__init__(tokenizer, 1 << 16)
        self.rng = rng

    async def agenerate(self, prompt, params=None, **kwargs):
        await asyncio.sleep(self.rng.random() * 0.01)
        return await super().agenerate(prompt, params, **kwargs)


def _prompts(monkeypatch, tokenizer, workload, seed: int, concurrency: int) -> list[list[int]]:
    rng = random.Random(seed)
    build = lanes.build_pipeline

    def jittery_pipeline(spec, engine):
        pipeline = build(spec, engine)
        prepare = pipeline.prepare

        def slow_prepare(*args, **kwargs):
            time.sleep(rng.random() * 0.01)  # worker threads finish out of order
            return prepare(*args, **kwargs)

        pipeline.prepare = slow_prepare
        return pipeline

    monkeypatch.setattr(lanes, "build_pipeline", jittery_pipeline)
    spec = lanes.lane_specs(["ragkv"])[0]
    result = lanes.run_lane(
        spec,
        workload,
        lambda _: _JitteryEngine(tokenizer, rng),
        SamplingParams(max_tokens=2),
        concurrency=concurrency,
    )
    return [r.prompt_token_ids for r in result.records]


@pytest.mark.parametrize("seed", [1, 2])
def test_a_lane_assembles_in_arrival_order_whatever_the_scheduling(
    monkeypatch, tiny_model, small_config, seed
):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    workload = synthetic_workload(small_config(requests=24, topics=4, seed=seed))
    one_at_a_time = _prompts(monkeypatch, tokenizer, workload, seed, concurrency=1)
    for run in range(3):
        assert _prompts(monkeypatch, tokenizer, workload, 10 * seed + run, concurrency=6) == (
            one_at_a_time
        )
