"""Each fact about a request is computed once (issue 28): its blocks are hashed once, in the
caller's thread for the prompt, and kept across preemption; a residency probe hashes its
tokens once and takes no request state."""

from __future__ import annotations

import threading

import pytest
from support import ids

from ragkv.cache_engine import Engine, SamplingParams, block_hash

BLOCK = 16


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
    prompts = [ids(10 + i, 30) for i in range(4)]
    with Engine.from_pretrained(llama_dir, device="cpu", kv_cache_tokens=10 * BLOCK) as engine:
        outs = engine.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
        assert engine.stats().preemptions > 0
    full_blocks = sum((30 + 20) // BLOCK for _ in outs)
    assert sum(hashed_blocks.values()) == full_blocks
    stepping = hashed_blocks.get("ragkv-engine", 0)
    assert stepping == full_blocks - 4 * (30 // BLOCK)  # the prompts' were hashed by callers


def test_a_residency_probe_hashes_once_outside_the_lock_with_no_request(
    llama_dir, hashed_blocks, monkeypatch
):
    # Before, a probe built a throw-away request, made manager state for it under the core
    # lock (hashing there) and freed it again.
    from ragkv.cache_engine.kv_cache_manager import KVCacheManager

    tokens = ids(1, 100)
    with Engine.from_pretrained(llama_dir, device="cpu", kv_cache_tokens=2048) as engine:
        engine.generate(tokens, SamplingParams(max_tokens=1))
        hashed_blocks.clear()

        def no_request_state(self, request):
            raise AssertionError("a residency probe made per-request manager state")

        monkeypatch.setattr(KVCacheManager, "_state", no_request_state)
        assert engine.cached_prefix_length(tokens) == 96
        assert engine.cached_prefix_length(tokens, cache_salt="tenant") == 0
    assert sum(hashed_blocks.values()) == 2 * (100 // BLOCK)
    assert "ragkv-engine" not in hashed_blocks  # hashed in the caller's thread


@pytest.fixture
def validations(monkeypatch):
    """Counts SamplingParams validations."""
    from ragkv.cache_engine import sampling_params

    count = [0]
    real = sampling_params.SamplingParams.validate

    def counting(self, vocab_size=None):
        count[0] += 1
        return real(self, vocab_size)

    monkeypatch.setattr(sampling_params.SamplingParams, "validate", counting)
    return count


def test_sampling_settings_are_validated_once_and_frozen(llama_dir, validations):
    import dataclasses

    params = SamplingParams(max_tokens=3, stop=["x"])
    assert validations[0] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.max_tokens = 5
    with Engine.from_pretrained(llama_dir, device="cpu", kv_cache_tokens=2048) as engine:
        engine.generate(ids(2, 20), params)
        assert validations[0] == 1  # the engine checked only the vocabulary bound
        pytest.importorskip("fastapi")
        import httpx

        from ragkv.integrations.openai.server.app import create_app
        from ragkv.integrations.openai.server.thread import ServerThread

        with ServerThread(create_app(engine, api_key="k-0123456789")) as url:
            validations[0] = 0
            response = httpx.post(
                url + "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "temperature": 0},
                headers={"Authorization": "Bearer k-0123456789"},
                timeout=60,
            )
            assert response.status_code == 200, response.text
    assert validations[0] == 1  # parsed once; the server's max_tokens default checks itself


def test_the_stop_decision_is_made_once_per_token_by_the_scheduler(llama_dir, monkeypatch):
    # EOS, stop token ids and the length limit are the scheduler's; the detokenizer only
    # looks for stop strings (before, it decided the same three again on every token).
    from ragkv.cache_engine.detokenizer import IncrementalDetokenizer

    def refuse(self, token_id):
        raise AssertionError("the detokenizer decided a stop the scheduler had decided")

    monkeypatch.setattr(IncrementalDetokenizer, "_decide", refuse)
    tokens = ids(3, 20)
    with Engine.from_pretrained(llama_dir, device="cpu", kv_cache_tokens=2048) as engine:
        free = engine.generate(tokens, SamplingParams(max_tokens=6, ignore_eos=True))
        stopped = engine.generate(
            tokens, SamplingParams(max_tokens=6, stop_token_ids=[free.token_ids[2]])
        )
    assert free.finish_reason == "length" and len(free.token_ids) == 6
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[:3]
