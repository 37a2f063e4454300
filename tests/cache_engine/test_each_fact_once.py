"""Each fact about a request is computed once (issue 28): its blocks are hashed once, in the
caller's thread for the prompt, and kept across preemption; a residency probe hashes its
tokens once and takes no request state."""

from __future__ import annotations

import random
import threading

import pytest

from ragkv.cache_engine import Engine, SamplingParams, block_hash

BLOCK = 16


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


@pytest.fixture
def hashed_blocks(monkeypatch):
    """Counts blocks hashed, and in which threads (name -> blocks)."""
    counts: dict[str, int] = {}
    real = block_hash._chained_digests

    def counting(parent, blocks, one):
        name = threading.current_thread().name
        counts[name] = counts.get(name, 0) + len(blocks)
        return real(parent, blocks, one)

    monkeypatch.setattr(block_hash, "_chained_digests", counting)
    return counts


def test_every_block_is_hashed_once_even_across_preemption(llama_dir, hashed_blocks):
    # 10 blocks; four requests growing to 50 tokens (3 full blocks each) cannot all fit, so
    # some are preempted and recomputed. Before, the manager dropped a preempted request's
    # hashes with its blocks and hashed its tokens again on readmission.
    prompts = [prompt(10 + i, 30) for i in range(4)]
    with Engine.from_pretrained(llama_dir, device="cpu", kv_cache_tokens=10 * BLOCK) as engine:
        outs = engine.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
        assert engine.stats().preemptions > 0
    full_blocks = sum((30 + 20) // BLOCK for _ in outs)
    assert sum(hashed_blocks.values()) == full_blocks
    stepping = hashed_blocks.get("ragkv-engine", 0)
    assert stepping == full_blocks - 4 * (30 // BLOCK)  # the prompts' were hashed by callers


def test_a_residency_probe_hashes_once_and_leaves_no_state(llama_dir, hashed_blocks):
    ids = prompt(1, 100)
    with Engine.from_pretrained(llama_dir, device="cpu", kv_cache_tokens=2048) as engine:
        engine.generate(ids, SamplingParams(max_tokens=1))
        hashed_blocks.clear()
        assert engine.cached_prefix_length(ids) == 96
        assert engine.cached_prefix_length(ids, cache_salt="tenant") == 0
        assert not engine.kv._requests  # no throw-away request state
    assert sum(hashed_blocks.values()) == 2 * (100 // BLOCK)
