"""``ragkv serve`` over real HTTP on loopback: OpenAI shapes, prefix-cache reporting, auth,
bad input, metrics, timeouts and disconnects (blocks return to the pool)."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("fastapi")

from support import ids, sse_payloads

from ragkv.cache_engine import SamplingParams  # noqa: E402

GREEDY = {"temperature": 0, "ignore_eos": True}


def test_completion_with_token_ids_matches_a_direct_engine_call(client, serve_engine):
    prompt = ids(1, 40)
    body = client.post(
        "/v1/completions",
        json={"prompt": prompt, "max_tokens": 6, "return_token_ids": True, **GREEDY},
    ).json()
    direct = serve_engine.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    (choice,) = body["choices"]
    assert body["object"] == "text_completion"
    assert choice["token_ids"] == direct.token_ids
    assert choice["text"] == direct.text
    assert choice["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == 40 and body["usage"]["completion_tokens"] == 6
    assert "cached_tokens" in body["usage"]["prompt_tokens_details"]


def test_streamed_completion_is_openai_sse_with_a_usage_chunk(client):
    prompt = "The quick brown fox jumps over the lazy dog, " * 4  # several full KV blocks
    request = {"prompt": prompt, "max_tokens": 8, **GREEDY}
    full = client.post("/v1/completions", json=request).json()
    response = client.post(
        "/v1/completions",
        json={**request, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = sse_payloads(response.text)
    *deltas, usage = chunks
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert "".join(c["choices"][0]["text"] for c in deltas) == full["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in deltas][-1] == "length"
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 8
    assert usage["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # same prompt again


def test_stream_without_include_usage_sends_no_usage_chunk(client):
    response = client.post(
        "/v1/completions", json={"prompt": "abc", "max_tokens": 3, "stream": True, **GREEDY}
    )
    assert all(c["choices"] and "usage" not in c for c in sse_payloads(response.text))


def test_chat_completion_renders_the_chat_template(client, serve_engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    request = {"messages": messages, "max_tokens": 5, "return_token_ids": True, **GREEDY}
    body = client.post("/v1/chat/completions", json=request).json()
    expected = serve_engine.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    (choice,) = body["choices"]
    assert body["object"] == "chat.completion"
    assert choice["prompt_token_ids"] == list(expected)
    assert choice["message"]["role"] == "assistant"
    stream = client.post("/v1/chat/completions", json={**request, "stream": True})
    chunks = sse_payloads(stream.text)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == choice["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_with_ragkv_chunks_is_deduplicated_and_assembled_on_the_server(client, serve_engine):
    chunk_a = "Paged attention stores keys and values in fixed-size blocks."
    chunk_b = "Prefix caching reuses blocks whose tokens were already computed."
    request = {
        "messages": [{"role": "user", "content": "What is reused?"}],
        "ragkv": {"chunks": [chunk_a, {"content": chunk_b, "source_id": "doc"}, chunk_a]},
        "max_tokens": 4,
        "return_token_ids": True,
        **GREEDY,
    }
    body = client.post("/v1/chat/completions", json=request).json()
    assert body["ragkv"]["chunks_in"] == 3 and body["ragkv"]["chunks_out"] == 2
    prompt = serve_engine.tokenizer.decode(body["choices"][0]["prompt_token_ids"])
    assert prompt.count(chunk_a) == 1 and prompt.count(chunk_b) == 1
    assert "What is reused?" in prompt


def test_shared_prefix_is_reported_as_cached_and_another_salt_is_not(client, serve_engine):
    prefix = ids(2, 64)
    first = client.post(
        "/v1/completions", json={"prompt": prefix + ids(3, 5), "max_tokens": 2, **GREEDY}
    ).json()
    second = client.post(
        "/v1/completions", json={"prompt": prefix + ids(4, 5), "max_tokens": 2, **GREEDY}
    ).json()
    salted = client.post(
        "/v1/completions",
        json={"prompt": prefix + ids(4, 5), "max_tokens": 2, "cache_salt": "tenant-b", **GREEDY},
    ).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


PROTECTED = [
    ("GET", "/v1/models", None),
    ("GET", "/metrics", None),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
]


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic test-key-0123456789"}],
    ids=["missing", "wrong", "wrong-scheme"],
)
@pytest.mark.parametrize(("method", "path", "payload"), PROTECTED, ids=[p for _, p, _ in PROTECTED])
def test_every_endpoint_but_health_needs_the_api_key(base_url, headers, method, path, payload):
    response = httpx.request(method, base_url + path, json=payload, headers=headers)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_health_and_models_answer(base_url, client, serve_engine):
    assert httpx.get(base_url + "/health").status_code == 200
    (card,) = client.get("/v1/models").json()["data"]
    assert card["id"] == serve_engine.model_name


BAD_BODIES = [
    ("malformed-json", b'{"prompt": "x",', 400),
    ("not-an-object", b"[1, 2]", 400),
    ("prompt-wrong-type", {"prompt": 5}, 400),
    ("prompt-empty-list", {"prompt": []}, 400),
    ("max-tokens-string", {"prompt": "x", "max_tokens": "9"}, 400),
    ("stream-not-bool", {"prompt": "x", "stream": "yes"}, 400),
    ("negative-temperature", {"prompt": "x", "temperature": -1}, 400),
    ("token-outside-vocab", {"prompt": [1, 99999]}, 400),
    ("prompt-too-long", {"prompt": [5] * 1100}, 400),
    ("n-above-one", {"prompt": "x", "n": 2}, 400),
    ("unknown-model", {"prompt": "x", "model": "gpt-4"}, 404),
    ("huge-body", {"prompt": "x" * 100_000}, 413),
]


@pytest.mark.parametrize(("case", "body", "status"), BAD_BODIES, ids=[c for c, _, _ in BAD_BODIES])
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(client, case, body, status):
    if isinstance(body, bytes):
        response = client.post(
            "/v1/completions", content=body, headers={"Content-Type": "application/json"}
        )
    else:
        response = client.post("/v1/completions", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    ok = client.post("/v1/completions", json={"prompt": "still there?", "max_tokens": 1})
    assert ok.status_code == 200


def test_a_huge_chunked_body_without_length_is_refused_while_reading(client):
    def body():
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"x" * 1024
        yield b'"}'

    response = client.post(
        "/v1/completions", content=body(), headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 413


def test_chat_errors_name_the_bad_field(client):
    response = client.post("/v1/chat/completions", json={"messages": [{"content": "no role"}]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages[0]"
    response = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "top_p": 0},
    )
    assert response.json()["error"]["param"] == "top_p"


def test_metrics_expose_the_engine_counters(client, serve_engine):
    from prometheus_client.parser import text_string_to_metric_families

    client.post("/v1/completions", json={"prompt": ids(9, 40), "max_tokens": 1})
    client.post("/v1/completions", json={"prompt": ids(9, 40), "max_tokens": 1})
    text = client.get("/metrics").text
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    stats = serve_engine.stats()
    assert samples["ragkv_prompt_tokens_total"] == stats.prompt_tokens
    assert samples["ragkv_prompt_tokens_cached_total"] == stats.prefill_tokens_reused > 0
    assert samples["ragkv_prefix_cache_hit_rate"] == pytest.approx(stats.hit_rate)
    assert samples["ragkv_kv_blocks"] == stats.num_blocks
    assert "ragkv_requests_waiting" in samples and "ragkv_kv_cache_usage" in samples
    assert 'ragkv_http_requests_total{route="/v1/completions",status="200"}' in text


LONG = 1000  # tokens a long request would decode if nobody aborted it


def long_request(**extra) -> dict:
    return {"prompt": ids(11, 12), "max_tokens": LONG, **GREEDY, **extra}


def assert_aborted_early(baseline, after, requests: int = 1) -> None:
    assert after.num_free_blocks == baseline.num_free_blocks
    assert after.requests_finished == baseline.requests_finished + requests
    assert after.decode_tokens - baseline.decode_tokens < requests * LONG // 2


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(
    base_url, api_key, serve_engine, wait_until_idle
):
    baseline = serve_engine.stats()
    headers = {"Authorization": f"Bearer {api_key}"}
    with (
        httpx.Client(base_url=base_url, headers=headers, timeout=60) as c,
        c.stream("POST", "/v1/completions", json=long_request(stream=True)) as response,
    ):
        lines = response.iter_lines()
        received = [line for line, _ in zip(lines, range(6), strict=False) if line]
        assert received and all(line.startswith("data: ") for line in received)
        assert serve_engine.stats().num_free_blocks < baseline.num_free_blocks
    wait_until_idle(serve_engine, baseline.num_free_blocks)
    assert_aborted_early(baseline, serve_engine.stats())


def test_a_client_that_gives_up_on_a_plain_request_frees_its_blocks(
    base_url, api_key, serve_engine, wait_until_idle
):
    baseline = serve_engine.stats()
    headers = {"Authorization": f"Bearer {api_key}"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base_url + "/v1/completions", json=long_request(), headers=headers, timeout=0.3)
    wait_until_idle(serve_engine, baseline.num_free_blocks)
    assert_aborted_early(baseline, serve_engine.stats())


def test_request_timeout_aborts_with_504_and_frees_blocks(
    start_server, api_key, serve_engine, wait_until_idle
):
    url = start_server(request_timeout_s=0.2)
    baseline = serve_engine.stats()
    headers = {"Authorization": f"Bearer {api_key}"}
    response = httpx.post(url + "/v1/completions", json=long_request(), headers=headers, timeout=60)
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "timeout"
    stream = httpx.post(
        url + "/v1/completions", json=long_request(stream=True), headers=headers, timeout=60
    )
    assert sse_payloads(stream.text)[-1]["error"]["code"] == "timeout"
    wait_until_idle(serve_engine, baseline.num_free_blocks)
    assert_aborted_early(baseline, serve_engine.stats(), requests=2)


def test_chat_without_max_tokens_fits_a_pool_smaller_than_the_context(
    open_engine, start_server, api_key
):
    """OpenAI clients omit max_tokens; the default must respect the KV pool, not only the
    context, or every such request is refused."""
    import httpx

    with open_engine(kv_cache_tokens=256, max_model_len=1024) as small:
        url = start_server(engine=small)
        r = httpx.post(
            f"{url}/v1/chat/completions",
            json={
                "model": small.model_name,
                "messages": [{"role": "user", "content": "hello"}],
                "temperature": 0,
            },
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=60,
        )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_health_reports_the_engine_and_answers_503_once_it_cannot_serve(
    open_engine, start_server, api_key
):
    engine = open_engine(kv_cache_tokens=256)
    url = start_server(engine=engine)
    engine.generate([5, 6, 7], SamplingParams(max_tokens=1))
    probe = httpx.get(f"{url}/health", timeout=60)  # no key: the verdict, no internals
    assert probe.status_code == 200 and probe.json() == {"status": "ok"}
    key = {"Authorization": f"Bearer {api_key}"}
    ok = httpx.get(f"{url}/health", timeout=60, headers=key)
    assert ok.status_code == 200
    assert ok.json()["status"] == "ok" and ok.json()["thread_alive"] is True
    assert ok.json()["consecutive_failures"] == 0
    engine.close()
    assert httpx.get(f"{url}/health", timeout=60).json() == {"status": "unhealthy"}
    down = httpx.get(f"{url}/health", timeout=60, headers=key)
    assert down.status_code == 503
    assert down.json() == {"status": "unhealthy", "reason": "the engine is closed"}
