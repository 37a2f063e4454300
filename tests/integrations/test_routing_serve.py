"""ReplicaRouter end to end: three ``ragkv serve`` replicas on loopback (in-thread uvicorn,
tiny random-weight model, small KV pools each), driven through ``ReplicaRouter.from_urls``."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from ragkv.cache_engine import SamplingParams
from ragkv.integrations.routing import ReplicaRouter

PARAMS = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0)
DOC_TOKENS = 64  # four 16-token blocks


def doc(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(DOC_TOKENS)]


def prompt(d: int, q: int) -> list[int]:
    return doc(d) + [500 + q, 501, 502]


@pytest.fixture
def replicas(serve_model_dir, api_key):
    """Three live servers, each its own engine with a 48-block pool; stopped at the end."""
    pytest.importorskip("fastapi")
    from ragkv.cache_engine import Engine
    from ragkv.integrations.openai.server.app import create_app
    from ragkv.integrations.openai.server.thread import ServerThread

    engines = [
        Engine.from_pretrained(
            serve_model_dir, device="cpu", kv_cache_tokens=768, max_model_len=512
        )
        for _ in range(3)
    ]
    threads = [ServerThread(create_app(e, api_key=api_key)) for e in engines]
    urls = [t.start() + "/v1" for t in threads]
    yield engines, threads, urls
    for t in threads:
        t.stop()
    for e in engines:
        e.close()


def served(engines) -> list[int]:
    return [e.stats().requests_finished for e in engines]


def test_shared_prefix_requests_land_together_and_reuse_the_cache(
    replicas, serve_model_dir, api_key
):
    engines, _, urls = replicas
    with ReplicaRouter.from_urls(urls, tokenizer=serve_model_dir, api_key=api_key) as router:
        firsts = [router.generate(prompt(d, 0), PARAMS) for d in range(3)]
        assert [o.usage.cached_tokens for o in firsts] == [0, 0, 0]
        assert served(engines) == [1, 1, 1]  # three cold documents, three replicas
        for q in range(1, 4):
            for d in range(3):
                assert router.generate(prompt(d, q), PARAMS).usage.cached_tokens == DOC_TOKENS
        s = router.stats()
        assert [r.succeeded for r in s.replicas] == [4, 4, 4] and s.imbalance == 1.0
        assert sum(r.predicted_cached_tokens for r in s.replicas) == 9 * DOC_TOKENS
        assert sum(r.reported_cached_tokens for r in s.replicas) == 9 * DOC_TOKENS
    # Round-robin over the same servers (another salt, so nothing above is reused) spreads
    # each document over the replicas: its follow-ups mostly recompute it.
    with ReplicaRouter.from_urls(
        urls, tokenizer=serve_model_dir, api_key=api_key, routing="round-robin"
    ) as rr:
        cached = [
            rr.generate(prompt(d, q), PARAMS, cache_salt="rr").usage.cached_tokens
            for d in range(3)
            for q in range(4)
        ]
    assert sum(cached) < 9 * DOC_TOKENS


def test_killing_a_replica_mid_run_loses_no_request(replicas, serve_model_dir, api_key):
    engines, threads, urls = replicas
    router = ReplicaRouter.from_urls(
        urls, tokenizer=serve_model_dir, api_key=api_key, timeout_s=20, backoff_s=30
    )
    for d in range(3):  # one document per replica
        router.generate(prompt(d, 0), PARAMS)
    assert served(engines) == [1, 1, 1]
    victim = 0  # holds document 0: a third of the requests below prefer it
    done = threading.Semaphore(0)

    def one(i: int) -> int:
        d, q = i % 3, 1 + i // 3
        if i % 2:
            deltas = list(router.stream(prompt(d, q), PARAMS))
            out = deltas[-1].output
        else:
            out = router.generate(prompt(d, q), PARAMS)
        done.release()
        return len(out.token_ids)

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(one, i) for i in range(9)]
        for _ in range(3):
            done.acquire()
        # Mid-run: requests still in flight on the victim finish; new connections are refused.
        threads[victim].stop()
        futures += [pool.submit(one, i) for i in range(9, 18)]  # 3 of them prefer the victim
        results = [f.result() for f in futures]
    assert results == [2] * 18  # every request answered, streamed or not
    s = router.stats()
    assert s.replicas[victim].healthy is False
    assert s.failovers >= 1
    assert sum(r.succeeded for r in s.replicas) == 18 + 3
    assert all(r.in_flight == 0 for r in s.replicas)
    router.close()


def test_pipeline_runs_unchanged_over_in_process_replicas(replicas):
    import ragkv

    engines, _, _ = replicas
    router = ReplicaRouter(engines)  # in-process engines: no HTTP
    pipe = ragkv.Pipeline(router, default_params=PARAMS)
    chunks = ["Paris is the capital of France.", "Rome is the capital of Italy."] * 2
    first = pipe.answer("Capital of France?", chunks, system="Answer briefly.")
    again = pipe.answer("Capital of France?", chunks, system="Answer briefly.")
    streamed = list(pipe.stream("Capital of France?", chunks, system="Answer briefly."))
    direct = engines[0].generate(first.output.prompt_token_ids, PARAMS)
    assert first.output.token_ids == again.output.token_ids == direct.token_ids
    assert streamed[-1].answer.output.token_ids == direct.token_ids
    assert again.usage.cached_tokens > 0  # routed back to the replica that held it
    assert first.dedup.chunks_out == 2
    assert router.stats().requests == 3


def test_framework_adapters_run_over_the_router(replicas, serve_model_dir, api_key):
    pytest.importorskip("langchain_core")
    pytest.importorskip("llama_index.core")
    from langchain_core.messages import HumanMessage

    from ragkv.integrations.langchain import ChatRagKV
    from ragkv.integrations.llama_index import RagKVLLM

    _, _, urls = replicas
    with ReplicaRouter.from_urls(urls, tokenizer=serve_model_dir, api_key=api_key) as router:
        chat = ChatRagKV(engine=router, max_tokens=2)
        question = [HumanMessage("tell me about paged attention " * 8)]
        first, second = chat.invoke(question), chat.invoke(question)
        assert first.content == second.content
        assert second.usage_metadata["input_token_details"]["cache_read"] > 0
        llm = RagKVLLM(engine=router, max_tokens=2)
        assert llm.complete("hello", formatted=True).text
        assert router.stats().requests == 3
