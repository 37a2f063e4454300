"""``ragkv serve --reuse blend``: a chat request opts into chunk reuse in its ``ragkv``
extension, gets an approximate answer whose usage says what was reused, and a server
without the flag (or a malformed opt-in) answers 400 naming the field."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

GREEDY = {"temperature": 0, "max_tokens": 2}
CHUNKS = [
    "Paged attention stores keys and values in fixed-size blocks of sixteen tokens each.",
    "Prefix caching reuses blocks whose tokens were already computed by earlier requests.",
    "The scheduler packs prefills and decodes of many requests under one token budget.",
    "Rotary position embeddings rotate each key by an angle proportional to its position.",
]


def chat(client: httpx.Client, chunks: list[str], question: str, **ragkv) -> httpx.Response:
    return client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": question}],
            "ragkv": {"chunks": chunks, "system": "Answer from the context.", **ragkv},
            **GREEDY,
        },
    )


@pytest.fixture(scope="module")
def blend_client(start_server, api_key):
    url = start_server(reuse="blend")
    with httpx.Client(
        base_url=url, headers={"Authorization": f"Bearer {api_key}"}, timeout=60
    ) as c:
        yield c


def test_a_request_opting_in_reuses_chunks_seen_at_another_position(blend_client):
    first = chat(blend_client, CHUNKS[:3], "What is stored in blocks?")
    assert first.status_code == 200, first.text
    assert "reused_nonprefix_tokens" not in first.json()["usage"]
    reused = 0
    # The server's canonical order keeps known chunks in one order; a subset that misses
    # one of them moves the others to new positions, after other content.
    for i, subset in enumerate([CHUNKS[1:3], CHUNKS[0:3:2], CHUNKS[2:3]]):
        answer = chat(blend_client, subset, f"Question {i}?", reuse="blend", k=1)
        assert answer.status_code == 200, answer.text
        reused += answer.json()["usage"].get("reused_nonprefix_tokens", 0)
    assert reused > 0
    # The server's /metrics counts the same (every request so far on this server included).
    text = blend_client.get("/metrics").text
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["ragkv_prompt_tokens_reused_nonprefix_total"] >= reused
    for name in (
        "prompt_tokens_reused_approximate_prefix",
        "blend_fallbacks",
        "blend_probe_fallbacks",
        "blend_waits",
    ):
        assert samples[f"ragkv_{name}_total"] >= 0


def test_malformed_opt_ins_are_refused_with_the_field(blend_client):
    for ragkv, param in [
        ({"reuse": "magic"}, "ragkv.reuse"),
        ({"reuse": "blend", "k": -1}, "ragkv.k"),
        ({"reuse": "blend", "k": True}, "ragkv.k"),
        ({"reuse": "blend", "strategy": "attention"}, "ragkv.strategy"),
        ({"k": 4}, "ragkv.k"),
        ({"reuse": "blend", "ratio": 1.5}, "ragkv.ratio"),
        ({"reuse": "blend", "ratio": 10**400}, "ragkv.ratio"),  # too large for a float
        ({"reuse": "blend", "ratio": "0.1"}, "ragkv.ratio"),
        ({"reuse": "blend", "strategy": "none", "ratio": 0.2}, "ragkv.ratio"),
        ({"reuse": "blend", "strategy": "first-k", "head": 4}, "ragkv.head"),  # deviation's
        ({"reuse": "blend", "strategy": "deviation", "head": 5000}, "ragkv.head"),
        ({"ratio": 0.15}, "ragkv.ratio"),
    ]:
        response = chat(blend_client, CHUNKS[:2], "Q?", **ragkv)
        assert response.status_code == 400, (ragkv, response.text)
        assert response.json()["error"]["param"] == param
    valid = {"reuse": "blend", "strategy": "deviation", "ratio": 0.15, "head": 2}
    assert chat(blend_client, CHUNKS[:2], "Q?", **valid).status_code == 200


def test_absent_or_null_settings_mean_blend_configs_default_and_the_strategys_ratio():
    from ragkv.cache_engine.chunk_reuse import BlendConfig
    from ragkv.integrations.openai.protocol import parse_chat

    def reuse(**ragkv):
        body = {"messages": [{"role": "user", "content": "Q?"}], "ragkv": {"chunks": ["c"]}}
        body["ragkv"].update(reuse="blend", **ragkv)
        rag = parse_chat(body).rag
        assert rag is not None
        return rag.reuse

    assert reuse() == reuse(strategy=None, k=None, ratio=None, head=None) == BlendConfig()
    assert reuse() == BlendConfig("deviation", k=16, ratio=0.15)
    assert reuse(head=4) == BlendConfig("deviation", k=16, ratio=0.15, head=4)
    # an explicit first-k or none means what it did before deviation became the default
    assert reuse(strategy="first-k", k=16) == BlendConfig("first-k", k=16, ratio=0.0)
    assert reuse(strategy="none", ratio=None) == BlendConfig("none")


def test_a_server_without_the_flag_refuses_the_opt_in(client):
    response = chat(client, CHUNKS[:2], "Q?", reuse="blend")
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "ragkv.reuse"
    assert "--reuse blend" in response.json()["error"]["message"]
