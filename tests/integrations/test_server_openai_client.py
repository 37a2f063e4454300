"""The official ``openai`` client against ``ragkv serve`` (optional test dependency)."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

PROMPT = "Retrieval augmented generation reuses the same passages again and again. " * 3
GREEDY = {"temperature": 0, "max_tokens": 6}


@pytest.fixture
def client(base_url, api_key):
    with openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0) as c:
        yield c


def test_completions_stream_and_not_agree_and_report_cached_tokens(client, serve_engine):
    model = serve_engine.model_name
    first = client.completions.create(model=model, prompt=PROMPT, **GREEDY)
    stream = client.completions.create(
        model=model, prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == first.choices[0].text
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    salted = client.completions.create(
        model=model, prompt=PROMPT, extra_body={"cache_salt": "other-tenant"}, **GREEDY
    )
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    assert salted.choices[0].text == first.choices[0].text


def test_chat_completions_stream_and_not(client, serve_engine):
    messages = [{"role": "user", "content": "Say something."}]
    full = client.chat.completions.create(
        model=serve_engine.model_name, messages=messages, **GREEDY
    )
    chunks = list(
        client.chat.completions.create(
            model=serve_engine.model_name, messages=messages, stream=True, **GREEDY
        )
    )
    assert full.choices[0].message.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens_details.cached_tokens is not None


def test_errors_arrive_as_the_clients_typed_exceptions(client, base_url, serve_engine):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=serve_engine.model_name, prompt="x", temperature=-2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-this-one", prompt="x")
    with (
        openai.OpenAI(base_url=base_url + "/v1", api_key="wrong", max_retries=0) as bad,
        pytest.raises(openai.AuthenticationError),
    ):
        bad.models.list()
    assert [m.id for m in client.models.list()] == [serve_engine.model_name]
