"""Issue 14 on the server side, over real HTTP on loopback: no request can hurt another.

Bad input is a 400 naming the field (never a 500 or a leaked tokenizer error), tenants never
share cached blocks or learned chunk order, oversized RAG requests are refused before any
work, foreign Host names and non-JSON POSTs are refused, every stream ends with an error
event or ``[DONE]``, and large bodies are parsed off the event loop.
"""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("fastapi")

from support import ids, running_servers, sse_payloads

from ragkv.errors import ConfigError, InvalidInputError  # noqa: E402
from ragkv.integrations.openai.limits import RequestLimits  # noqa: E402

GREEDY = {"temperature": 0, "ignore_eos": True}
KEYS = {"key-alice-0123456789": "alice", "key-bob-0123456789": "bob"}


@pytest.fixture
def serve(serve_engine):
    """``serve(**create_app_kwargs) -> (base_url, app)``; servers stop when the test ends."""
    with running_servers(serve_engine) as start:
        yield start


def as_tenant(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def post_raw(client: httpx.Client, path: str, text: str) -> httpx.Response:
    """POST ``text`` as the body verbatim (so a JSON escape like ``\\ud800`` stays an escape)."""
    return client.post(path, content=text.encode(), headers={"Content-Type": "application/json"})


def assert_openai_400(response: httpx.Response, param_prefix: str) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] is not None and error["param"].startswith(param_prefix), error
    return error


# -- 1. errors are mapped by RagkvError.param, bad values are 400s -----------------------------


def test_a_seed_beyond_int64_is_a_400_naming_seed(client):
    for seed in (2**64, 2**63, -(2**63) - 1):
        response = client.post(
            "/v1/completions",
            json={"prompt": "abc", "max_tokens": 1, "temperature": 1, "seed": seed},
        )
        assert_openai_400(response, "seed")
    for seed in (2**63 - 1, -1, -(2**63)):  # negative seeds: their two's complement
        ok = client.post(
            "/v1/completions",
            json={"prompt": "abc", "max_tokens": 1, "temperature": 1, "seed": seed},
        )
        assert ok.status_code == 200, ok.text


LONE_SURROGATE = "\\ud800"  # a JSON escape: json.loads turns it into a lone surrogate

SURROGATE_BODIES = [
    ("/v1/completions", '{"prompt": "a%sb", "max_tokens": 1}', "prompt"),
    ("/v1/completions", '{"prompt": "ab", "max_tokens": 1, "stop": ["x%s"]}', "stop"),
    ("/v1/completions", '{"prompt": "ab", "max_tokens": 1, "cache_salt": "s%s"}', "cache_salt"),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "hi%s"}], "max_tokens": 1}',
        "messages[0]",
    ),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "q"}], "max_tokens": 1, '
        '"ragkv": {"chunks": ["c%s"]}}',
        "ragkv.chunks[0]",
    ),
]


@pytest.mark.parametrize(
    ("path", "template", "param"), SURROGATE_BODIES, ids=[p for _, _, p in SURROGATE_BODIES]
)
def test_a_lone_surrogate_is_a_400_naming_the_field(client, path, template, param):
    assert_openai_400(post_raw(client, path, template % LONE_SURROGATE), param)
    ok = client.post("/v1/completions", json={"prompt": "still there?", "max_tokens": 1})
    assert ok.status_code == 200


def test_a_validation_error_is_reported_with_its_own_param(client, serve_engine, monkeypatch):
    """The server reports ``RagkvError.param``; it does not guess the field from the text."""

    async def refuse(*args, **kwargs):
        raise InvalidInputError("nothing in this text names the field", param="cache_salt")
        yield  # pragma: no cover - makes this an async generator like Engine.astream

    monkeypatch.setattr(serve_engine, "astream", refuse)
    response = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 1})
    error = assert_openai_400(response, "cache_salt")
    assert error["param"] == "cache_salt"


def test_a_bad_sampling_value_names_its_field(client):
    for field, value in (("top_p", 0), ("min_p", 2), ("temperature", -1), ("top_k", -5)):
        response = client.post(
            "/v1/completions", json={"prompt": "abc", "max_tokens": 1, field: value}
        )
        assert assert_openai_400(response, field)["param"] == field


# -- 2. tenants: one cache namespace per API key -------------------------------------------------


def test_tenants_never_share_cached_blocks(serve):
    url, _ = serve(api_keys=KEYS)
    alice, bob = (as_tenant(k) for k in KEYS)
    request = {"prompt": ids(21, 64) + ids(22, 3), "max_tokens": 2, **GREEDY}
    with httpx.Client(base_url=url, timeout=60) as http:
        assert cached(http.post("/v1/completions", json=request, headers=alice)) == 0
        assert cached(http.post("/v1/completions", json=request, headers=bob)) == 0
        assert cached(http.post("/v1/completions", json=request, headers=alice)) == 64
        # A client's salt only subdivides its own tenant's namespace.
        salted = {**request, "cache_salt": "team-1"}
        assert cached(http.post("/v1/completions", json=salted, headers=bob)) == 0
        assert cached(http.post("/v1/completions", json=salted, headers=bob)) == 64
        assert cached(http.post("/v1/completions", json=salted, headers=alice)) == 0
        wrong = http.post("/v1/completions", json=request, headers=as_tenant("key-eve"))
        assert wrong.status_code == 401


def test_a_keyless_server_is_one_anonymous_tenant_and_says_so(serve, caplog):
    with caplog.at_level("WARNING", logger="ragkv.integrations.openai.server.auth"):
        url, _ = serve(api_key=None)
    assert "without an API key" in caplog.text
    request = {"prompt": ids(23, 40), "max_tokens": 1, **GREEDY}
    with httpx.Client(base_url=url, timeout=60) as http:
        assert cached(http.post("/v1/completions", json=request)) == 0
        assert cached(http.post("/v1/completions", json=request)) == 32


def test_the_tenant_salt_is_fixed_size_and_unambiguous():
    from ragkv.integrations.openai.server.auth import tenant_salt

    salts = {
        tenant_salt("a", None),
        tenant_salt("a", ""),
        tenant_salt("a", "b"),
        tenant_salt("ab", None),
        tenant_salt("b", "a"),
        tenant_salt("a", "x" * 10_000),
    }
    assert len(salts) == 6
    assert {len(s) for s in salts} == {64}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not valid JSON"),
        ('["k"]', "non-empty JSON object"),
        ("{}", "non-empty JSON object"),
        ('{"k1": "a", "k1": "b"}', "same API key twice"),
        ('{"k1": 3}', "non-empty string"),
        ('{"k1": ""}', "non-empty string"),
        ('{" k1": "a"}', "whitespace"),
    ],
)
def test_an_api_keys_file_is_validated_at_start(tmp_path, text, message):
    from ragkv.integrations.openai.server.cli import load_api_keys

    path = tmp_path / "keys.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_api_keys(path)


def test_api_key_and_api_keys_together_are_refused(tmp_path, monkeypatch, capsys):
    pytest.importorskip("uvicorn")
    from ragkv.cli import main

    path = tmp_path / "keys.json"
    path.write_text(json.dumps(KEYS))
    assert main(["serve", "--api-key", "k", "--api-keys", str(path)]) == 1
    assert "not both" in capsys.readouterr().err


# -- 3. per-tenant learned chunk order ------------------------------------------------------------


def rag_body(chunks, **extra) -> dict:
    return {
        "messages": [{"role": "user", "content": "q?"}],
        "ragkv": {"chunks": chunks},
        "max_tokens": 1,
        **extra,
    }


def fresh_pair_and_others(engine, passages: list[str]) -> tuple[str, str, list[str]]:
    """``passages[4]`` and ``passages[2]`` in the order a fresh assembler puts them, and three
    of the other passages."""
    import ragkv

    pair = [passages[4], passages[2]]
    fresh = ragkv.Pipeline(engine).prepare("q?", pair).plan
    first, second = (pair[s.index] for s in fresh.spans("chunk"))
    return first, second, [p for p in passages if p not in pair][:3]


def chunk_order(engine, response: httpx.Response, chunks: list[str]) -> list[int]:
    assert response.status_code == 200, response.text
    prompt = engine.tokenizer.decode(response.json()["choices"][0]["prompt_token_ids"])
    found = sorted((prompt.index(c), i) for i, c in enumerate(chunks))
    return [i for _, i in found]


def test_one_tenants_traffic_never_reorders_anothers_chunks(serve, serve_engine):
    passages = [
        f"Passage {i}: " + "the cache keeps blocks of keys and values. " * 3 for i in range(6)
    ]
    first, second, hot = fresh_pair_and_others(serve_engine, passages)
    url, _ = serve(api_keys=KEYS)
    alice, bob = (as_tenant(k) for k in KEYS)

    def ask(chunks, headers):
        body = rag_body(chunks, return_token_ids=True, **GREEDY)
        return http.post("/v1/chat/completions", json=body, headers=headers)

    with httpx.Client(base_url=url, timeout=60) as http:
        for other in (hot[0], hot[1], hot[2], hot[0]):  # alice makes `second` stable (hot)
            assert ask([second, other], alice).status_code == 200
        learned = chunk_order(serve_engine, ask([first, second], alice), [first, second])
        bobs = chunk_order(serve_engine, ask([first, second], bob), [first, second])
    assert learned == [1, 0]  # alice's own traffic moved her stable chunk first
    assert bobs == [0, 1]  # bob is served the order a fresh assembler picks


def test_learned_order_belongs_to_the_tenant_not_to_each_client_salt(serve, serve_engine):
    """A tenant's clients share its learned order whatever salts they pick, so a client
    cycling salts neither starts over nor pushes other tenants' state out."""
    passages = [f"Passage {i}: " + "blocks of keys and values stay cached. " * 3 for i in range(6)]
    first, second, hot = fresh_pair_and_others(serve_engine, passages)
    url, _ = serve(api_keys=KEYS)
    alice = as_tenant(next(iter(KEYS)))

    def ask(chunks, salt):
        body = rag_body(chunks, return_token_ids=True, cache_salt=salt, **GREEDY)
        return http.post("/v1/chat/completions", json=body, headers=alice)

    with httpx.Client(base_url=url, timeout=60) as http:
        for i, other in enumerate((hot[0], hot[1], hot[2], hot[0])):
            assert ask([second, other], f"salt-{i}").status_code == 200
        order = chunk_order(serve_engine, ask([first, second], "another-salt"), [first, second])
    assert order == [1, 0]


# -- 4. size limits: refused before any tokenization ---------------------------------------------


def test_oversized_rag_requests_are_refused_before_any_work(serve, monkeypatch):
    limits = RequestLimits(max_chunk_bytes=1000, max_chunks=4, max_rag_bytes=1500)
    url, app = serve(api_key=None, limits=limits, max_body_bytes=1 << 20)
    prepared = []
    pipeline = app.state.ragkv.pipeline
    real = pipeline.prepare
    monkeypatch.setattr(pipeline, "prepare", lambda *a, **k: prepared.append(1) or real(*a, **k))
    cases = [
        (["x" * 1001], "ragkv.chunks[0]", "chunk_too_large"),
        (["ok", "é" * 501], "ragkv.chunks[1]", "chunk_too_large"),  # bytes, not characters
        ([f"c{i}" for i in range(5)], "ragkv.chunks", "too_many_chunks"),
        (["a" * 800, {"content": "b" * 800}], "ragkv.chunks", "chunks_too_large"),
        (["y" * 8_000_000], "ragkv.chunks[0]", "chunk_too_large"),
    ]
    with httpx.Client(base_url=url, timeout=60) as http:
        for chunks, param, code in cases[:4]:
            error = assert_openai_400(
                http.post("/v1/chat/completions", json=rag_body(chunks)), param
            )
            assert error["param"] == param and error["code"] == code
        assert prepared == []
        ok = http.post("/v1/chat/completions", json=rag_body(["cache " * 116, "block " * 116]))
        assert ok.status_code == 200 and prepared == [1]
        over_body = http.post("/v1/chat/completions", json=rag_body(cases[4][0]))
        assert over_body.status_code == 413  # the raw body limit comes first


def test_prompt_tokens_and_stop_strings_are_bounded(serve):
    limits = RequestLimits(max_prompt_tokens=50, max_stop_strings=2)
    url, _ = serve(api_key=None, limits=limits)
    with httpx.Client(base_url=url, timeout=60) as http:
        for body, param in (
            ({"prompt": ids(31, 51)}, "prompt"),
            ({"prompt": "word " * 200}, "prompt"),
            ({"prompt": "x", "stop": ["a", "b", "c"]}, "stop"),
        ):
            response = http.post("/v1/completions", json={"max_tokens": 1, **body})
            assert assert_openai_400(response, param)["param"] == param
        chat = {"messages": [{"role": "user", "content": "word " * 200}], "max_tokens": 1}
        assert_openai_400(http.post("/v1/chat/completions", json=chat), "messages")
        ok = http.post("/v1/completions", json={"prompt": ids(31, 50), "max_tokens": 1})
        assert ok.status_code == 200


def test_a_limit_below_one_is_a_config_error():
    with pytest.raises(ConfigError, match="max_chunks"):
        RequestLimits(max_chunks=0)


def test_the_default_prompt_limit_is_the_model_context(serve, serve_engine):
    url, app = serve(api_key=None)
    assert app.state.ragkv.limits.max_prompt_tokens == serve_engine.max_model_len - 1
    response = httpx.post(
        url + "/v1/completions", json={"prompt": [5] * serve_engine.max_model_len}, timeout=60
    )
    assert_openai_400(response, "prompt")


# -- 5. DNS rebinding and cross-site POSTs --------------------------------------------------------


def test_a_foreign_host_name_is_refused(serve):
    url, _ = serve(api_key=None)
    body = json.dumps({"prompt": "x", "max_tokens": 1})
    with httpx.Client(base_url=url, timeout=60) as http:
        for host in ("rebind.evil.example", "rebind.evil.example:80", "127.0.0.2"):
            for content_type in ("text/plain", "application/json"):
                response = http.post(
                    "/v1/completions",
                    content=body,
                    headers={"Host": host, "Content-Type": content_type},
                )
                assert response.status_code == 421, (host, content_type)
                assert response.json()["error"]["code"] == "host_not_allowed"
        refused = http.get("/v1/models", headers={"Host": "rebind.evil.example"})
        assert refused.status_code == 421
        for host in ("localhost", "LOCALHOST:8000", "127.0.0.1", "[::1]:1234", "[::1]"):
            assert http.get("/v1/models", headers={"Host": host}).status_code == 200, host
        assert http.get("/health", headers={"Host": "probe.internal"}).status_code == 200


def test_allowed_hosts_are_configurable(serve):
    url, _ = serve(api_key=None, allowed_hosts=["api.example.com"])
    with httpx.Client(base_url=url, timeout=60) as http:
        assert http.get("/v1/models", headers={"Host": "api.example.com:443"}).status_code == 200
        assert http.get("/v1/models", headers={"Host": "localhost"}).status_code == 421
    url, _ = serve(api_key=None, allowed_hosts=["*"])
    assert httpx.get(url + "/v1/models", headers={"Host": "any.example"}).status_code == 200


def test_the_cli_default_allows_the_bind_address():
    from ragkv.integrations.openai.server.cli import allowed_hosts

    assert "10.1.2.3" in allowed_hosts("10.1.2.3", None)
    assert "localhost" in allowed_hosts("127.0.0.1", None)
    assert allowed_hosts("0.0.0.0", "a.example, b.example") == ["a.example", "b.example"]
    with pytest.raises(ConfigError):
        allowed_hosts("127.0.0.1", " , ")


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_post_body_must_be_declared_json(client, content_type):
    headers = {} if content_type is None else {"Content-Type": content_type}
    response = client.post(
        "/v1/completions", content=b'{"prompt": "x", "max_tokens": 1}', headers=headers
    )
    assert response.status_code == 415
    assert response.json()["error"]["code"] == "unsupported_media_type"
    ok = client.post(
        "/v1/completions",
        content=b'{"prompt": "x", "max_tokens": 1}',
        headers={"Content-Type": "Application/JSON; charset=utf-8"},
    )
    assert ok.status_code == 200


# -- 6. every stream ends ------------------------------------------------------------------------


def test_an_unexpected_failure_mid_stream_ends_with_an_error_event(
    client, serve_engine, monkeypatch
):
    real = serve_engine.astream

    async def one_delta_then_fail(*args, **kwargs):
        stream = real(*args, **kwargs)
        try:
            yield await anext(stream)
        finally:
            await stream.aclose()
        raise RuntimeError("a bug that is no RagkvError")

    monkeypatch.setattr(serve_engine, "astream", one_delta_then_fail)
    response = client.post(
        "/v1/completions",
        json={"prompt": ids(41, 8), "max_tokens": 50, "stream": True, **GREEDY},
    )
    *deltas, last = sse_payloads(response.text)
    assert deltas and all("choices" in d for d in deltas)
    assert last["error"]["type"] == "server_error"
    assert "RuntimeError" not in response.text  # no internals leak to the client


# -- 7. large bodies are parsed off the event loop --------------------------------------------------


def test_a_large_body_is_decoded_on_a_worker_thread(serve, monkeypatch):
    import threading

    url, _ = serve(api_key=None, max_body_bytes=1 << 20)
    threads = []
    real = json.loads

    def spy(data, *args, **kwargs):
        if isinstance(data, bytes | bytearray) and len(data) > 100_000:
            threads.append(threading.current_thread().name)
        return real(data, *args, **kwargs)

    monkeypatch.setattr(json, "loads", spy)
    body = {"prompt": "x", "max_tokens": 1, "user": "u" * 200_000}
    response = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200
    assert threads and "ragkv-http" not in threads  # the uvicorn event loop's thread


def test_an_engine_failure_is_a_500_that_keeps_the_connection_alive(
    base_url, api_key, serve_engine, monkeypatch
):
    """A failure of one request must not close its keep-alive connection: the next request
    of that client on it (already sent, under load) would fail with a connection reset."""
    import http.client
    from urllib.parse import urlsplit

    async def fail(*args, **kwargs):
        raise RuntimeError("the model forward failed")
        yield  # pragma: no cover - an async generator like Engine.astream

    url = urlsplit(base_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    body = json.dumps({"prompt": "abc", "max_tokens": 1})
    with monkeypatch.context() as patch:
        patch.setattr(serve_engine, "astream", fail)
        connection.request("POST", "/v1/completions", body=body, headers=headers)
        failed = connection.getresponse()
        error = json.loads(failed.read())["error"]
    assert failed.status == 500 and error["type"] == "server_error"
    assert "the model forward failed" not in error["message"]
    connection.request("POST", "/v1/completions", body=body, headers=headers)  # same socket
    assert connection.getresponse().status == 200
    connection.close()


def test_a_tenant_of_the_same_name_on_another_deployment_shares_nothing(start_server):
    """Two servers over one cache (here one engine; a shared disk store is the same case):
    tenant "acme" of one deployment never reads the blocks of "acme" of another, unless the
    operator gives both the same tenant secret."""
    prompt = {"prompt": list(range(5, 101)), "max_tokens": 1, "temperature": 0}

    def cached(url: str, key: str) -> int:
        response = httpx.post(
            url + "/v1/completions", json=prompt, headers={"Authorization": f"Bearer {key}"}
        )
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    first = start_server(api_key=None, api_keys={"key-one-0123": "acme"})
    other = start_server(api_key=None, api_keys={"key-two-0123": "acme"})
    assert cached(first, "key-one-0123") == 0
    assert cached(first, "key-one-0123") > 0  # the deployment's own cache works
    assert cached(other, "key-two-0123") == 0  # same tenant name, other deployment
    shared_a = start_server(api_key=None, api_keys={"key-3-0123456": "acme"}, tenant_secret="s")
    shared_b = start_server(api_key=None, api_keys={"key-4-0123456": "acme"}, tenant_secret="s")
    assert cached(shared_a, "key-3-0123456") == 0
    assert cached(shared_b, "key-4-0123456") > 0  # one secret: one namespace, on purpose


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "x" * (70 << 10)}]}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}] * 9}, "messages"),
        ({"messages": [{"role": "x" * 5000, "content": "hi"}]}, "messages[0].role"),
        (
            {
                "messages": [{"role": "user", "content": "q"}],
                "ragkv": {"chunks": [], "system": "s" * (70 << 10)},
            },
            "ragkv.system",
        ),
    ],
    ids=["text-bytes", "message-count", "unknown-role", "rag-system-bytes"],
)
def test_all_prompt_text_is_bounded_before_tokenizing(start_server, api_key, body, param):
    from ragkv.integrations.openai.limits import RequestLimits

    url = start_server(limits=RequestLimits(max_text_bytes=64 << 10, max_messages=8))
    response = httpx.post(
        url + "/v1/chat/completions",
        json={**body, "max_tokens": 1},
        headers={"Authorization": f"Bearer {api_key}"},
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_the_surrogate_scan_skips_bodies_without_an_escape():
    from ragkv.integrations.openai.limits import may_hold_lone_surrogate

    assert not may_hold_lone_surrogate(b'{"a": "' + b"x" * 100_000 + b'"}')
    assert may_hold_lone_surrogate(rb'{"a": "\ud800"}')
    assert may_hold_lone_surrogate(rb'{"a": "\uDBFF"}')
    assert not may_hold_lone_surrogate(rb'{"a": "\u00e9"}')


def test_metrics_of_a_multi_tenant_server_need_the_admin_key(start_server):
    keys = {"key-alice-0123": "alice", "key-bob-012345": "bob"}
    url = start_server(api_key=None, api_keys=keys, admin_key="admin-key-0123")

    def metrics(key: str) -> httpx.Response:
        return httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {key}"})

    refused = metrics("key-alice-0123")  # a tenant would see every tenant's traffic
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_key_required"
    assert metrics("admin-key-0123").status_code == 200
    assert metrics("wrong").status_code == 403
    no_admin = start_server(api_key=None, api_keys=keys)
    assert httpx.get(no_admin + "/metrics", headers={"Authorization": "Bearer key-bob-012345"}
                     ).status_code == 403  # fmt: skip


def test_a_tenant_past_its_share_gets_429_and_others_are_still_served(serve_engine, api_key):
    from ragkv.integrations.openai.server.app import create_app
    from ragkv.integrations.openai.server.thread import ServerThread

    keys = {"key-flood-0123": "flood", "key-quiet-0123": "quiet"}
    app = create_app(serve_engine, api_keys=keys, max_requests_per_tenant=2, max_requests=3)
    served = app.state.ragkv
    thread = ServerThread(app)
    url = thread.start()
    short = {"prompt": "hi", "max_tokens": 1}

    def post(key: str) -> httpx.Response:
        return httpx.post(
            url + "/v1/completions", json=short, headers={"Authorization": f"Bearer {key}"}
        )

    try:
        served.in_flight["flood"] = 2  # the flooding tenant's two requests are in flight
        refused = post("key-flood-0123")
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert post("key-quiet-0123").status_code == 200  # another tenant still has room
        served.in_flight["quiet"] = 1  # three in flight in all: the server's bound
        assert post("key-quiet-0123").status_code == 429
        served.in_flight.clear()
        assert post("key-flood-0123").status_code == 200
        assert served.in_flight == {}  # every answered request gave its slot back
    finally:
        thread.stop()


def test_one_tenants_flood_of_large_chats_does_not_queue_anothers_small_chat(serve_engine):
    # Twelve ~0.9 MB chats of one tenant are tokenized (then refused: too many tokens) while
    # another tenant sends a two-word chat. First come, first served (asyncio.to_thread) ran
    # the small chat's tokenization after the whole flood, and the tokenizer held the GIL
    # (the event loop stood still); now a work thread is kept for other tenants and the
    # tokenizer releases the GIL, so the small chat is answered first.
    import threading
    import time

    from ragkv.integrations.openai.server.app import create_app
    from ragkv.integrations.openai.server.thread import ServerThread

    keys = {"key-flood-0123": "flood", "key-quiet-0123": "quiet"}
    app = create_app(serve_engine, api_keys=keys, work_threads=2, max_body_bytes=2 << 20)
    workers = app.state.ragkv.workers
    thread = ServerThread(app)
    url = thread.start()
    big = {"messages": [{"role": "user", "content": "word " * 180_000}], "max_tokens": 1}
    small = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 1, **GREEDY}
    finished: list[tuple[float, str, int]] = []

    def send(key: str, body: dict, name: str) -> None:
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120,
                              headers=as_tenant(key))  # fmt: skip
        finished.append((time.monotonic(), name, response.status_code))

    try:
        flood = [threading.Thread(target=send, args=("key-flood-0123", big, "flood"))
                 for _ in range(12)]  # fmt: skip
        for t in flood:
            t.start()
        # Every flood request has arrived (waiting to be tokenized, or already refused: on a
        # fast machine the first ones may be done before the last one is decoded).
        for _ in range(1200):
            if workers.pending("flood") + len(finished) == 12:
                break
            time.sleep(0.05)
        pending = workers.pending("flood")
        done_before = len(finished)
        assert pending + done_before == 12 and pending >= 4
        send("key-quiet-0123", small, "quiet")
        for t in flood:
            t.join(timeout=120)
    finally:
        thread.stop()
    order = [name for _, name, _ in sorted(finished)]
    statuses = {name: status for _, name, status in finished}
    assert statuses["quiet"] == 200 and statuses["flood"] == 400  # too many prompt tokens
    # Not behind the flood: at most the one being tokenized finishes after it was sent.
    assert len(order) == 13 and order.index("quiet") <= done_before + 1
