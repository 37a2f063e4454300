"""64 concurrent streaming clients against one ``ragkv serve``: every request completes and
each gets exactly its own greedy continuation (no tokens mixed between requests)."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

pytest.importorskip("fastapi")

from ragkv.cache_engine import SamplingParams  # noqa: E402

CLIENTS = 64
REQUESTS_PER_CLIENT = 3
MAX_TOKENS = 8


def prompt_for(client: int, turn: int) -> list[int]:
    rng = random.Random(client * 100 + turn)
    shared = [7, 8, 9, 10] * 4  # one shared block: requests also hit the prefix cache
    return shared + [rng.randrange(3, 512) for _ in range(rng.randrange(4, 40))]


async def stream_tokens(client: httpx.AsyncClient, prompt: list[int]) -> tuple[list[int], str]:
    body = {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    tokens, finish = [], None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[len("data: ") :])["choices"][0]
            tokens += choice["token_ids"]
            finish = choice["finish_reason"] or finish
    return tokens, finish


async def test_64_concurrent_streaming_clients_each_get_their_own_tokens(
    base_url, api_key, serve_engine
):
    results: dict[tuple[int, int], tuple[list[int], str]] = {}
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    headers = {"Authorization": f"Bearer {api_key}"}

    async def run_client(i: int, http: httpx.AsyncClient) -> None:
        for turn in range(REQUESTS_PER_CLIENT):
            results[i, turn] = await stream_tokens(http, prompt_for(i, turn))

    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, limits=limits, timeout=120
    ) as http:
        await asyncio.gather(*(run_client(i, http) for i in range(CLIENTS)))

    keys = sorted(results)
    assert len(keys) == CLIENTS * REQUESTS_PER_CLIENT
    expected = serve_engine.generate(
        [prompt_for(i, turn) for i, turn in keys],
        SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    for key, direct in zip(keys, expected, strict=True):
        tokens, finish = results[key]
        assert finish == "length"
        assert tokens == direct.token_ids, key
