"""Load benchmark for ``ragkv serve``: many concurrent streaming clients, one engine.

Scenario (seeded): ``--clients`` coroutines each send ``--requests`` streamed completions
one after another. Every prompt is a shared RAG-style context (a system line plus passages
from the bundled pydoc corpus, the same for every request, so the prefix cache serves it)
followed by a per-request question. Reports per-request latency (p50/p99 of time to first
token and of total time), throughput, and the share of prompt tokens the server reported
as cached.

The server runs in this process on a background thread (``ServerThread``) unless ``--url``
points at a running one; client and server then share one Python process (and its GIL), so
the latencies are an upper bound for a separate server process.

Usage: ``python benchmarks/serve_load.py [--model DIR] [--clients 64] [--requests 3]
[--max-tokens 16] [--dtype bfloat16] [--url http://127.0.0.1:8000] [--json]``; the shape
of issue 31's aiperf runs (a ~512-token shared context, ~64 new tokens, 8 out):
``--context-chars 2200 --question-words 48 --max-tokens 8 --warm-up 2``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx


def build_prompts(
    clients: int,
    requests: int,
    context_chars: int,
    question_words: int = 0,
    label: str = "Question",
) -> list[list[str]]:
    """Each client's prompts: the shared context, then a question of its own; with
    ``question_words``, that many words drawn per request follow it, so every request has
    about that many new prompt tokens no cache holds (aiperf's "synthetic input" shape)."""
    import random

    from ragkv.corpus import demo_corpus

    passages = [c.content for c in demo_corpus()[:8]]
    context = "Answer from these passages.\n\n" + "\n\n".join(passages)
    context = context[:context_chars]
    words = sorted(set(" ".join(passages).split()))
    rng = random.Random(0)

    def question(i: int, j: int) -> str:
        tail = " ".join(rng.choice(words) for _ in range(question_words))
        return f"{label} {i}.{j}: {tail} what does passage {j % 8} say?"

    return [[f"{context}\n\n{question(i, j)}" for j in range(requests)] for i in range(clients)]


async def one_request(http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = None
    usage = None
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and first is None:
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
    end = time.perf_counter()
    return {"ttft": (first or end) - start, "total": end - start, "usage": usage}


async def run_load(
    url: str,
    api_key: str | None,
    prompts: list[list[str]],
    max_tokens: int,
    warm: list[str] | None = None,
) -> dict:
    """Each client's prompts in turn, all clients at once, after ``warm`` one by one."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=600) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        for prompt in warm or []:
            await one_request(http, model, prompt, max_tokens)
        results: list[dict] = []

        async def client(own: list[str]) -> None:
            for prompt in own:
                results.append(await one_request(http, model, prompt, max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(client(own) for own in prompts))
        wall = time.perf_counter() - start
    return summarize(results, wall)


def summarize(results: list[dict], wall: float) -> dict:
    def pct(values: list[float], q: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    totals = [r["total"] for r in results]
    ttfts = [r["ttft"] for r in results]
    prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in results)
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results)
    completion = sum(r["usage"]["completion_tokens"] for r in results)
    return {
        "requests": len(results),
        "wall_s": wall,
        "latency_p50_s": statistics.median(totals),
        "latency_p99_s": pct(totals, 0.99),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": pct(ttfts, 0.99),
        "requests_per_s": len(results) / wall,
        "output_tokens_per_s": completion / wall,
        "prompt_tokens": prompt_tokens,
        "cached_share": cached / prompt_tokens if prompt_tokens else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="a running server (default: start one here)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model", default=None, help="checkpoint dir (default: embedded)")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--kv-cache-tokens", type=int, default=65536)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=3, help="per client, sequential")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--context-chars", type=int, default=1500)
    parser.add_argument(
        "--question-words", type=int, default=0, help="random words per request (new tokens)"
    )
    parser.add_argument(
        "--warm-up", type=int, default=0, help="requests sent one by one first, not measured"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    prompts = build_prompts(args.clients, args.requests, args.context_chars, args.question_words)
    # Their own label right after the context, so no measured prompt finds its words cached.
    warm = build_prompts(1, args.warm_up, args.context_chars, args.question_words, "Warm-up")[0]
    if args.url:
        report = asyncio.run(run_load(args.url, args.api_key, prompts, args.max_tokens, warm))
    else:
        from ragkv.cache_engine import Engine
        from ragkv.integrations.openai.server.app import create_app
        from ragkv.integrations.openai.server.thread import ServerThread

        with (
            Engine.from_pretrained(
                args.model, dtype=args.dtype, kv_cache_tokens=args.kv_cache_tokens
            ) as engine,
            ServerThread(create_app(engine)) as url,
        ):
            report = asyncio.run(run_load(url, None, prompts, args.max_tokens, warm))
    report.update(clients=args.clients, per_client=args.requests, max_tokens=args.max_tokens)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(
        f"{report['requests']} streamed requests ({args.clients} clients x {args.requests}), "
        f"max_tokens {args.max_tokens}, {report['wall_s']:.1f} s wall\n"
        f"  latency  p50 {report['latency_p50_s']:.3f} s   p99 {report['latency_p99_s']:.3f} s\n"
        f"  TTFT     p50 {report['ttft_p50_s']:.3f} s   p99 {report['ttft_p99_s']:.3f} s\n"
        f"  {report['requests_per_s']:.1f} req/s, {report['output_tokens_per_s']:.0f} output tok/s, "
        f"{report['cached_share']:.0%} of prompt tokens cached"
    )


if __name__ == "__main__":
    main()
