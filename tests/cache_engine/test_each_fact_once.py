"""Each fact about a request is computed once (issue 28): its blocks are hashed once, in the
caller's thread for the prompt, and kept across preemption; a residency probe hashes its
tokens once and takes no request state, and through a pipeline the probe's hashes are the
request's and its salt is digested once."""

from __future__ import annotations

import asyncio
import threading

import pytest
from support import ids, training_text

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
def salt_digests(monkeypatch):
    """Counts cache salts digested (the salt's blake3, whichever module asked)."""
    count = [0]
    real = block_hash.blake3

    def counting(data=b"", *args, **kwargs):
        if bytes(data).startswith(block_hash._SALT_LABEL):
            count[0] += 1
        return real(data, *args, **kwargs)

    monkeypatch.setattr(block_hash, "blake3", counting)
    return count


@pytest.fixture
def probed(monkeypatch):
    """Every candidate prompt the engine's residency probes were asked about."""
    prompts: list[list[int]] = []
    real = Engine.prefix_probe

    def recording(self, cache_salt=None):
        probe = real(self, cache_salt)

        def call(token_ids):
            prompts.append(list(token_ids))
            return probe(token_ids)

        return call

    monkeypatch.setattr(Engine, "prefix_probe", recording)
    return prompts


def _distinct_blocks(prompts: list[list[int]]) -> int:
    """Full blocks of ``prompts`` that differ by themselves or by what precedes them."""
    return len({tuple(p[: (k + 1) * BLOCK]) for p in prompts for k in range(len(p) // BLOCK)})


def test_a_pipeline_request_hashes_each_block_once_and_digests_its_salt_once(
    llama_dir, hashed_blocks, salt_digests, probed
):
    # Never-worse probes two candidates (canonical and as-given) that share their head.
    # Before, each probe hashed its whole candidate, the request hashed the sent one again,
    # and the salt was digested per probe and again by the request.
    import ragkv

    text = training_text()
    passages = [text[i][:300] for i in range(4)]
    system = "Answer the question from the context. " * 4
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    with Engine.from_pretrained(llama_dir, device="cpu", kv_cache_tokens=8192) as engine:
        pipe = ragkv.Pipeline(engine)

        def answer(call, question, chunks):
            probed.clear()
            hashed_blocks.clear()
            salt_digests[0] = 0
            if call == "answer":
                result = pipe.answer(question, chunks, system=system, cache_salt="t", params=params)
            elif call == "stream":
                deltas = pipe.stream(question, chunks, system=system, cache_salt="t", params=params)
                result = list(deltas)[-1].answer
            else:
                result = asyncio.run(
                    pipe.aanswer(question, chunks, system=system, cache_salt="t", params=params)
                )
            prompt = result.plan.token_ids
            assert len(probed) == 2 and prompt in probed  # canonical and as-given
            assert result.plan.stats.expected_as_given is not None
            assert _distinct_blocks(probed) < sum(len(p) // BLOCK for p in probed)  # shared
            generated = (len(prompt) + 5) // BLOCK - len(prompt) // BLOCK
            assert hashed_blocks.get("ragkv-engine", 0) == generated
            callers = sum(hashed_blocks.values()) - generated
            assert callers == _distinct_blocks(probed)  # the sent prompt's blocks: once
            assert salt_digests[0] == 1
            return result

        first = answer("answer", "What is this about?", passages)
        second = answer("stream", "And now?", passages[::-1])
        third = answer("aanswer", "Once more?", passages[1:] + passages[:1])
    assert second.usage.cached_tokens > 0 and third.usage.cached_tokens > 0
    assert first.plan.prompt_hashes is not None


def test_a_server_chat_request_hashes_each_block_once_and_digests_its_salt_once(
    llama_dir, hashed_blocks, salt_digests, probed
):
    # The server assembles through the pipeline in a worker thread; before, the prompt the
    # probe had hashed was hashed again when queued, and the salt digested again.
    pytest.importorskip("fastapi")
    import httpx

    from ragkv.integrations.openai.server.app import create_app
    from ragkv.integrations.openai.server.thread import ServerThread

    text = training_text()
    body = {
        "messages": [
            {"role": "system", "content": "Answer from the context. " * 4},
            {"role": "user", "content": "What is this about?"},
        ],
        "max_tokens": 5,
        "ragkv": {"chunks": [text[i][:300] for i in range(3)]},
    }
    with Engine.from_pretrained(llama_dir, device="cpu", kv_cache_tokens=8192) as engine:
        body["model"] = engine.model_name
        server = ServerThread(create_app(engine, api_key="k" * 20))
        url = server.start()
        try:
            headers = {"Authorization": "Bearer " + "k" * 20}
            with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
                client.post("/v1/chat/completions", json=body).raise_for_status()  # warm
                probed.clear()
                hashed_blocks.clear()
                salt_digests[0] = 0
                reply = client.post("/v1/chat/completions", json=body).json()
        finally:
            server.stop()
    prompt_tokens = reply["usage"]["prompt_tokens"]
    generated = (prompt_tokens + 5) // BLOCK - prompt_tokens // BLOCK
    assert probed and max(map(len, probed)) == prompt_tokens
    assert hashed_blocks.get("ragkv-engine", 0) <= generated
    assert sum(hashed_blocks.values()) - hashed_blocks.get("ragkv-engine", 0) == _distinct_blocks(
        probed
    )
    assert salt_digests[0] == 1


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
