"""A first request without max_tokens is bounded, and every request leaves one log line."""

from __future__ import annotations

import logging
import re

import httpx
import pytest

pytest.importorskip("fastapi")


MESSAGES = [{"role": "user", "content": "Tell me everything about caching."}]


@pytest.fixture(scope="module")
def capped(start_server, api_key):
    url = start_server(default_max_tokens=5)
    with httpx.Client(
        base_url=url, headers={"Authorization": f"Bearer {api_key}"}, timeout=60
    ) as client:
        yield client


def test_chat_without_max_tokens_stops_at_the_server_default(capped):
    # ignore_eos: the tiny random model would otherwise stop whenever it samples EOS.
    body = capped.post("/v1/chat/completions", json={"messages": MESSAGES, "ignore_eos": True})
    assert body.status_code == 200, body.text
    assert body.json()["usage"]["completion_tokens"] == 5
    assert body.json()["choices"][0]["finish_reason"] == "length"
    more = {"messages": MESSAGES, "ignore_eos": True, "max_tokens": 9}  # a request may ask more
    assert capped.post("/v1/chat/completions", json=more).json()["usage"]["completion_tokens"] == 9


def test_the_default_is_the_library_default(serve_engine):
    from ragkv.cache_engine.sampling_params import DEFAULT_MAX_TOKENS, SamplingParams
    from ragkv.integrations.openai.server.app import create_app

    assert SamplingParams().max_tokens == DEFAULT_MAX_TOKENS == 256
    assert create_app(serve_engine, api_key="k").state.ragkv.default_max_tokens == 256
    with pytest.raises(ValueError, match="default_max_tokens"):
        create_app(serve_engine, api_key="k", default_max_tokens=0)


def test_every_request_logs_one_access_line(capped, caplog):
    with caplog.at_level(logging.INFO, logger="ragkv.serve.access"):
        ok = capped.post(
            "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "temperature": 0}
        )
        streamed = capped.post(
            "/v1/chat/completions",
            json={"messages": MESSAGES, "max_tokens": 3, "stream": True, "ignore_eos": True},
        )
        refused = httpx.get(str(capped.base_url) + "/v1/models")  # no key: 401
        capped.get("/health")  # probes log at DEBUG only
    assert (ok.status_code, streamed.status_code, refused.status_code) == (200, 200, 401)
    lines = [r.getMessage() for r in caplog.records if r.name == "ragkv.serve.access"]
    assert len(lines) == 3, lines
    usage = ok.json()["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert lines[0].startswith("POST /v1/chat/completions 200 tenant=default ")
    assert f"prompt={usage['prompt_tokens']} cached={cached} generated=2 " in lines[0]
    assert "generated=3 " in lines[1]  # a stream logs what it sent, once it ended
    assert lines[2].startswith("GET /v1/models 401 tenant=- ")
    # The request's duration in seconds (a clock reading or milliseconds would be far larger).
    duration = re.search(r" (\d+\.\d{3})s$", lines[0])
    assert duration and float(duration.group(1)) < 60, lines[0]


async def test_a_failing_app_logs_status_500(caplog):
    from ragkv.integrations.openai.server.auth import Gate
    from ragkv.integrations.openai.server.metrics import ServerMetrics

    async def broken(scope, receive, send):
        raise RuntimeError("boom")

    gate = Gate(broken, tenants=None, allowed_hosts=None, max_body_bytes=1 << 20,
                metrics=ServerMetrics(None))  # fmt: skip
    scope = {"type": "http", "method": "GET", "path": "/x", "headers": []}
    with caplog.at_level(logging.INFO, logger="ragkv.serve.access"), pytest.raises(RuntimeError):
        await gate(scope, None, None)
    assert caplog.records[-1].getMessage().startswith("GET /x 500 tenant=anonymous ")


def test_a_developer_message_is_the_system_prompt_of_a_rag_request(capped):
    body = {
        "messages": [{"role": "developer", "content": "Be brief."}, MESSAGES[0]],
        "max_tokens": 1,
        "return_token_ids": True,
        "ragkv": {"chunks": ["Caching keeps results."]},
    }
    response = capped.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    bad = {**body, "messages": [{"role": "tool", "content": "x"}, MESSAGES[0]]}
    refused = capped.post("/v1/chat/completions", json=bad)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "history[0].role"
