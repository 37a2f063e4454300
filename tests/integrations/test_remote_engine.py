"""RemoteEngine: the Engine surface over HTTP. Against a live ``ragkv serve`` on loopback
(exact tokens, cached_tokens, salts, Pipeline), and against a scripted transport for the
failure paths (retries, fallbacks, unknown cache counts)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from support import ids

import ragkv
from ragkv.cache_engine import SamplingParams
from ragkv.cache_engine.outputs import Usage
from ragkv.errors import RemoteEngineError
from ragkv.integrations.openai import RemoteEngine

PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)


# -- against ragkv serve ---------------------------------------------------------------------


@pytest.fixture
def remote(base_url, api_key, serve_model_dir):
    pytest.importorskip("fastapi")
    with RemoteEngine(base_url + "/v1", tokenizer=serve_model_dir, api_key=api_key) as engine:
        yield engine


def test_sync_stream_and_async_calls_return_the_engines_exact_tokens(remote, serve_engine):
    prompt = ids(21, 30)
    direct = serve_engine.generate(prompt, PARAMS)
    out = remote.generate(prompt, PARAMS)
    deltas = list(remote.stream(prompt, PARAMS))

    async def both():
        agen = await remote.agenerate(prompt, PARAMS)
        adeltas = [d async for d in remote.astream(prompt, PARAMS)]
        await remote.aclose()
        return agen, adeltas

    aout, adeltas = asyncio.run(both())
    for result in (out, deltas[-1].output, aout, adeltas[-1].output):
        assert result.token_ids == direct.token_ids
        assert result.text == direct.text
        assert result.prompt_token_ids == prompt
        assert result.finish_reason == "length"
    assert "".join(d.text for d in deltas) == direct.text
    assert [t for d in adeltas for t in d.token_ids] == direct.token_ids
    assert deltas[-1].finish_reason == "length"


def test_cached_tokens_come_back_and_salts_isolate(remote):
    prompt = ids(22, 48)
    assert remote.generate(prompt, PARAMS).usage.cached_tokens == 0
    assert remote.generate(prompt, PARAMS).usage.cached_tokens == 32  # last token recomputed
    assert remote.generate(prompt, PARAMS, cache_salt="tenant-b").usage.cached_tokens == 0
    remote.cache_salt = "tenant-c"  # the default salt for calls without one
    assert remote.generate(prompt, PARAMS).usage.cached_tokens == 0


def test_pipeline_on_remote_engine_matches_pipeline_on_the_local_engine(remote, serve_engine):
    chunks = [
        "Blocks are hashed with their prefix.",
        "Duplicates are dropped.",
        "Blocks are hashed with their prefix.",
    ]
    local = ragkv.Pipeline(serve_engine).answer("How?", chunks, system="Be brief.", params=PARAMS)
    answer = ragkv.Pipeline(remote).answer("How?", chunks, system="Be brief.", params=PARAMS)
    assert answer.plan.token_ids == local.plan.token_ids
    assert answer.output.token_ids == local.output.token_ids
    assert answer.dedup.chunks_out == 2
    # The server keeps each tenant's blocks in its own namespace, apart from in-process
    # callers of the same engine: the first remote answer warmed it for the second.
    again = ragkv.Pipeline(remote).answer("How?", chunks, system="Be brief.", params=PARAMS)
    assert again.usage.cached_tokens > 0


def test_http_errors_become_remote_engine_errors(base_url, serve_model_dir, api_key):
    with RemoteEngine(base_url + "/v1", tokenizer=serve_model_dir, api_key="wrong") as bad:
        with pytest.raises(RemoteEngineError) as info:
            bad.generate([5, 6, 7], PARAMS)
        assert info.value.status_code == 401
    with RemoteEngine(
        base_url + "/v1", tokenizer=serve_model_dir, api_key=api_key, model="nope"
    ) as wrong:
        with pytest.raises(RemoteEngineError) as info:
            wrong.generate([5, 6, 7], PARAMS)
        assert info.value.status_code == 404


# -- scripted transport ------------------------------------------------------------------------


def completion(text: str = "ok", usage: dict | None = None) -> dict:
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
        "usage": usage or {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }


class Script:
    """A MockTransport handler answering with the queued responses, recording the bodies."""

    def __init__(self, *answers) -> None:
        self.answers = list(answers)
        self.bodies: list[dict] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(json.loads(request.content) if request.content else {})
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def scripted(script: Script, **kwargs) -> RemoteEngine:
    from support import tiny_tokenizer

    kwargs.setdefault("backoff_s", 0.0)
    return RemoteEngine(
        "http://remote.invalid/v1",
        tokenizer=tiny_tokenizer(),
        model="m",
        transport=httpx.MockTransport(script),
        **kwargs,
    )


def test_429_and_5xx_are_retried_then_succeed():
    script = Script(
        httpx.Response(429, headers={"Retry-After": "0"}),
        httpx.Response(503, json={"error": {"message": "busy"}}),
        httpx.ConnectError("refused"),
        httpx.Response(200, json=completion("fine")),
    )
    assert scripted(script).generate([1, 2, 3], PARAMS).text == "fine"
    assert len(script.bodies) == 4


def test_retries_give_up_with_the_last_status():
    script = Script(*[httpx.Response(502, json={"error": {"message": "bad gateway"}})] * 3)
    with pytest.raises(RemoteEngineError, match="bad gateway") as info:
        scripted(script, max_retries=2).generate([1, 2, 3], PARAMS)
    assert info.value.status_code == 502 and not script.answers


def test_client_errors_are_not_retried():
    script = Script(httpx.Response(401, json={"error": {"message": "no key"}}))
    with pytest.raises(RemoteEngineError) as info:
        scripted(script).generate("hello", PARAMS)
    assert info.value.status_code == 401 and len(script.bodies) == 1


def test_timeouts_are_retried_and_then_reported():
    script = Script(httpx.ReadTimeout("slow"), httpx.ReadTimeout("slow"))
    with pytest.raises(RemoteEngineError, match="timed out") as info:
        scripted(script, max_retries=1).generate([1, 2], PARAMS)
    assert info.value.status_code is None


def test_missing_cached_tokens_is_unknown_not_zero():
    script = Script(httpx.Response(200, json=completion()))
    usage = scripted(script).generate([1, 2, 3], PARAMS).usage
    assert isinstance(usage, Usage)
    assert usage.cached_tokens is None
    assert "prompt_tokens_details" not in usage.to_openai()


def test_a_server_refusing_token_ids_gets_text_from_then_on():
    script = Script(
        httpx.Response(400, json={"error": {"message": "prompt must be a string"}}),
        httpx.Response(200, json=completion("a")),
        httpx.Response(200, json=completion("b")),
    )
    engine = scripted(script)
    prompt = engine.tokenizer.encode("hello world")
    assert engine.generate(prompt, PARAMS).text == "a"
    assert engine.generate(prompt, PARAMS).text == "b"
    first, *text_bodies = script.bodies
    assert first["prompt"] == prompt and first["return_token_ids"] is True
    assert [b["prompt"] for b in text_bodies] == ["hello world"] * 2
    assert all("return_token_ids" not in b for b in text_bodies)


def test_another_400_on_a_token_id_prompt_keeps_token_ids():
    """A 400 that is the request's own (a bad setting) must not switch the client to text
    prompts for good: only one saying the prompt's type was refused does."""
    script = Script(
        httpx.Response(400, json={"error": {"message": "max_tokens is too large"}}),
        httpx.Response(200, json=completion("b")),
    )
    engine = scripted(script)
    prompt = engine.tokenizer.encode("hello world")
    with pytest.raises(RemoteEngineError, match="max_tokens"):
        engine.generate(prompt, PARAMS)
    assert engine.generate(prompt, PARAMS).text == "b"
    assert [b["prompt"] for b in script.bodies] == [prompt, prompt]


def test_sampling_params_and_salt_go_on_the_wire_and_defaults_stay_off():
    script = Script(httpx.Response(200, json=completion()), httpx.Response(200, json=completion()))
    engine = scripted(script, cache_salt="tenant")
    engine.generate([1, 2], SamplingParams(max_tokens=3, top_k=5, stop=["\n"], seed=1))
    engine.generate([1, 2], SamplingParams(max_tokens=3), cache_salt="override")
    tuned, plain = script.bodies
    assert tuned["top_k"] == 5 and tuned["stop"] == ["\n"] and tuned["seed"] == 1
    assert tuned["cache_salt"] == "tenant" and plain["cache_salt"] == "override"
    assert not {"top_k", "min_p", "stop", "ignore_eos", "seed"} & set(plain)


def sse(*events: dict) -> bytes:
    lines = [f"data: {json.dumps(e)}\n\n" for e in events]
    return ("".join(lines) + "data: [DONE]\n\n").encode()


def test_an_error_event_inside_a_stream_raises():
    body = sse(
        {"id": "c", "choices": [{"text": "a", "finish_reason": None}]},
        {"error": {"message": "timeout"}},
    )
    script = Script(httpx.Response(200, content=body))
    with pytest.raises(RemoteEngineError, match="timeout"):
        list(scripted(script).stream([1, 2], PARAMS))


def test_a_stream_without_usage_still_finishes_with_unknown_cache():
    body = sse(
        {"id": "c", "choices": [{"text": "a", "finish_reason": None}]},
        {"id": "c", "choices": [{"text": "b", "finish_reason": "stop"}]},
    )
    deltas = list(scripted(Script(httpx.Response(200, content=body))).stream([1, 2], PARAMS))
    assert [d.text for d in deltas] == ["a", "b"]
    assert deltas[-1].output.text == "ab" and deltas[-1].output.usage.cached_tokens is None


def test_langchain_usage_leaves_cache_read_out_when_the_server_does_not_report_it():
    """LangChain adds usage up field by field and refuses None: unknown is left out."""
    pytest.importorskip("langchain_core")
    from langchain_core.messages.ai import add_usage

    from ragkv.cache_engine.outputs import Usage
    from ragkv.integrations.langchain.chat_model import usage_metadata

    usage = usage_metadata(Usage(2, 1, None))
    assert "cache_read" not in usage["input_token_details"]
    assert add_usage(usage, usage)["total_tokens"] == 6


def test_framework_adapters_run_on_a_remote_engine(remote, serve_engine):
    """ChatRagKV and RagKVLLM take any EngineLike, not only the in-process Engine."""
    pytest.importorskip("langchain_core")
    pytest.importorskip("llama_index.core")
    from langchain_core.messages import HumanMessage

    from ragkv.integrations.langchain import ChatRagKV
    from ragkv.integrations.llama_index import RagKVLLM

    chat = ChatRagKV(engine=remote, max_tokens=4)
    message = chat.invoke([HumanMessage("tell me about paged attention")])
    assert 1 <= message.usage_metadata["output_tokens"] <= 4
    assert isinstance(message.usage_metadata["input_token_details"]["cache_read"], int)

    llm = RagKVLLM(engine=remote, max_tokens=4)
    assert llm.metadata.context_window > 0
    assert (
        llm.complete("hello", formatted=True).text
        == serve_engine.generate(
            list(serve_engine.tokenizer("hello", add_special_tokens=False)["input_ids"]),
            SamplingParams(max_tokens=4, temperature=0.0),
        ).text
    )


def test_framework_adapters_refuse_an_object_that_is_not_an_engine():
    pytest.importorskip("langchain_core")
    pytest.importorskip("llama_index.core")
    from ragkv.errors import InvalidInputError
    from ragkv.integrations.langchain import ChatRagKV
    from ragkv.integrations.llama_index import RagKVLLM

    for adapter in (ChatRagKV, RagKVLLM):
        with pytest.raises((InvalidInputError, ValueError), match="EngineLike"):
            adapter(engine=object())


def test_tokenizer_embedded_or_a_clear_error_offline(tmp_path, monkeypatch):
    """``tokenizer="embedded"`` is the embedded model's (a local ``ragkv serve``); a hub id
    that is not cached fails at once, saying what to pass, instead of retrying the hub."""
    import time

    from ragkv.cache_engine import default_model_path
    from ragkv.errors import InvalidInputError

    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf-cache"))
    engine = RemoteEngine("http://127.0.0.1:9/v1", tokenizer="embedded")
    assert engine.tokenizer.name_or_path == str(default_model_path())
    started = time.perf_counter()
    with pytest.raises(InvalidInputError, match="hf download.*'embedded'") as info:
        RemoteEngine("http://127.0.0.1:9/v1", tokenizer="some-org/not-cached-anywhere")
    assert info.value.param == "tokenizer" and time.perf_counter() - started < 10


def test_load_tokenizer_passes_objects_through_and_refuses_none():
    from ragkv.errors import InvalidInputError
    from ragkv.integrations.openai import load_tokenizer

    tokenizer = object()  # anything that is not a name or path is the tokenizer itself
    assert load_tokenizer(tokenizer) is tokenizer
    with pytest.raises(InvalidInputError, match="needs the server's tokenizer"):
        load_tokenizer(None)


def test_answers_are_bounded_in_size_time_and_shape(monkeypatch):
    """A misbehaving server cannot hold a call (trickling bytes), flood memory (a huge body
    or SSE line) or crash it with a malformed answer: each is a RemoteEngineError."""
    from ragkv.integrations.openai import client_reader

    monkeypatch.setattr(client_reader, "MAX_ANSWER_BYTES", 1000)
    huge = Script(httpx.Response(200, content=b'{"choices": [' + b" " * 5000 + b"]}"))
    with pytest.raises(RemoteEngineError, match="over 1000 bytes"):
        scripted(huge).generate([1, 2, 3], PARAMS)
    broken = Script(httpx.Response(200, content=b"not json"))
    with pytest.raises(RemoteEngineError, match="invalid JSON"):
        scripted(broken).generate([1, 2, 3], PARAMS)

    class Trickle(httpx.SyncByteStream):
        def __iter__(self):
            for _ in range(50):
                time.sleep(0.02)
                yield b" "

    slow = Script(httpx.Response(200, stream=Trickle()))
    started = time.perf_counter()
    with pytest.raises(RemoteEngineError, match="deadline_s"):
        scripted(slow, deadline_s=0.1).generate([1, 2, 3], PARAMS)
    assert time.perf_counter() - started < 0.9
    monkeypatch.setattr(client_reader, "MAX_SSE_LINE_CHARS", 100)
    long_line = Script(httpx.Response(200, content=b"data: " + b"x" * 500 + b"\n\n"))
    with pytest.raises(RemoteEngineError, match="line of"):
        list(scripted(long_line).stream([1, 2, 3], PARAMS))


@pytest.mark.parametrize(
    ("usage", "nonprefix", "approx_prefix", "approximate"),
    [
        ({}, 0, 0, False),  # another server: no ragkv extension
        ({"reused_nonprefix_tokens": 12}, 12, 0, True),
        ({"reused_approximate_prefix_tokens": 32}, 0, 32, True),
        ({"reused_nonprefix_tokens": "12", "reused_approximate_prefix_tokens": -3}, 0, 0, False),
    ],
)
def test_ragkvs_approximate_reuse_fields_reach_the_remote_output(
    usage, nonprefix, approx_prefix, approximate
):
    from ragkv.integrations.openai.client_reader import output_of

    body = {
        "id": "x",
        "choices": [{"text": "hi", "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 40, "completion_tokens": 1, **usage},
    }
    out = output_of(body, [1, 2, 3], 0.0)
    assert out.usage.reused_nonprefix_tokens == nonprefix
    assert out.usage.reused_approximate_prefix_tokens == approx_prefix
    assert out.approximate is approximate


def test_idle_connections_are_dropped_before_a_uvicorn_server_closes_them():
    # Both at 5 s, a request can go out on a connection the server is closing: a ReadError
    # after sending, which the router cannot safely resend (seen end to end over ragkv serve).
    uvicorn = pytest.importorskip("uvicorn")

    with RemoteEngine("http://127.0.0.1:9/v1", tokenizer="embedded") as engine:
        server_keep_alive = uvicorn.Config(app=None).timeout_keep_alive
        assert engine._limits.keepalive_expiry < server_keep_alive
        assert engine._limits.max_connections == 100  # httpx's default pool is kept

        # ...and both clients' pools use it (httpcore's pool keeps it privately).
        async def async_expiry() -> float:
            return engine._async_client()._transport._pool._keepalive_expiry

        assert engine._client._transport._pool._keepalive_expiry == engine._limits.keepalive_expiry
        assert asyncio.run(async_expiry()) == engine._limits.keepalive_expiry
