"""Fault soak for ``ragkv serve``: no request can hurt another, under load and failures.

One in-process server (``ServerThread``, loopback only) with three tenants (API keys) and one
engine. For ``--seconds`` (and at most ``--max-requests`` requests), ``--clients`` httpx
coroutines mix:

- valid greedy completions of the three tenants, plain and streamed, over a shared pool of
  token-id prompts whose references (a direct greedy ``engine.generate``) are computed once
  beforehand, before any fault is injected;
- malformed requests (bad JSON, wrong types, lone surrogates, out-of-range values, oversized
  chunks, wrong content type, foreign Host, wrong key): each must get a 4xx;
- streams the client drops after a few events, and requests whose client gives up after a
  short timeout (their prompts come from a separate pool, so they never blur the checks);
- with ``--reuse blend``: RAG chats that opt into approximate chunk reuse, over groups of
  text chunks in shuffled orders (each group's chunks appear only together);
- injected failures: the model runner's forward raises on a random ``--fault-rate`` share of
  steps. The engine then fails the requests of that step and flushes its prefix cache. For
  accounting only, the soak records which prompts each injected failure hit.

Checks (the JSON report has them all; the run fails if one is broken):

- ``lost == 0``: every valid request not hit by an injected fault is answered once (one
  response; a stream has exactly one finish and one ``[DONE]``), with output equal to its
  reference. A 5xx is explained only while the count of 5xx answers for a prompt does not
  exceed the count of injected failures that hit requests of that prompt.
- ``server_errors == 0``: no 5xx outside injected faults, and every malformed request is a 4xx.
- ``cross_tenant_hits == 0``. The first request of a (tenant, prompt) is a probe, sent alone:
  no other request of that tenant with that prompt is sent before the probe is answered, and
  prompts share no first block (distinct first tokens). The probe can therefore only reuse
  blocks of another tenant, so its ``cached_tokens`` must be 0. ``cross_tenant_probes``
  counts the probes sent after another tenant completed the same prompt with no cache flush
  in between (the ones that would have hit a shared block). With blend on, the first blend
  chat of a (tenant, chunk group) must also reuse nothing at another position
  (``reused_nonprefix_tokens`` 0): the tenant never sent those chunks, so any reuse would
  be another tenant's K/V. Blended answers are approximate; the exact requests, served by
  the same engine meanwhile, must still equal their direct greedy calls.
- the KV pool is all free at the end; RSS before and after are reported.

Usage: ``python benchmarks/soak.py [--seconds 120] [--clients 32] [--fault-rate 0.005]
[--model DIR | --tiny] [--reuse blend] [--json]``. ``--tiny`` serves a 2-layer random-weight checkpoint
(written to a temp dir, as the tests do); the default is the embedded model.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

TENANTS = {
    "soak-key-alice-0001": "alice",
    "soak-key-bob-0002": "bob",
    "soak-key-carol-0003": "carol",
}
MAX_TOKENS = 8  # per valid request
LONG_MAX_TOKENS = 200  # dropped streams and client timeouts: long enough to be cut short
# Share of each kind of request.
MIX = {
    "valid": 0.40,
    "valid-stream": 0.22,
    "malformed": 0.18,
    "dropped-stream": 0.10,
    "timeout": 0.10,
}
VALID_PROMPTS = 24
NOISE_PROMPTS = 16
BLEND_SHARE = 0.15  # of the mix, with reuse="blend"
BLEND_GROUPS = 6  # chunk groups; a blend chat sends 2-4 chunks of one group, shuffled
BLEND_GROUP_SIZE = 4


class InjectedFault(RuntimeError):
    """Raised by the wrapped model forward on purpose."""


@dataclass
class SoakReport:
    seconds: float = 0.0
    clients: int = 0
    requests: int = 0
    valid: int = 0
    valid_ok: int = 0
    streamed: int = 0
    malformed: int = 0
    blend: int = 0  # blend chats answered
    blend_reused_tokens: int = 0  # their reused_nonprefix_tokens, summed
    dropped_streams: int = 0
    client_timeouts: int = 0
    faults_injected: int = 0
    requests_failed_by_faults: int = 0
    lost: int = 0
    server_errors: int = 0
    mismatches: int = 0
    probes: int = 0
    cross_tenant_probes: int = 0
    cross_tenant_hits: int = 0
    same_tenant_cached_hits: int = 0
    pool_blocks: int = 0
    pool_free_after: int = 0
    rss_before_mb: float = 0.0
    rss_after_mb: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (
            self.lost == 0
            and self.server_errors == 0
            and self.mismatches == 0
            and self.cross_tenant_hits == 0
            and self.pool_free_after == self.pool_blocks
        )


class FaultInjector:
    """Wraps ``engine.runner.execute`` to raise :class:`InjectedFault` on a random share of
    steps, recording which prompts each injected fault hits (the requests running in that
    step: the engine fails exactly those)."""

    def __init__(self, engine: Any, rate: float, seed: int) -> None:
        self.engine = engine
        self.rate = rate
        self.rng = random.Random(seed)
        self.injected = 0
        self.hits: Counter = Counter()  # prompt (tuple of ids) -> requests failed by a fault
        self.lock = threading.Lock()
        self._execute = engine.runner.execute

    def __enter__(self) -> FaultInjector:
        def execute(batch: Any) -> Any:
            if self.rng.random() < self.rate:
                with self.lock:  # on the engine thread: the scheduler is not moving
                    self.injected += 1
                    self.hits.update(
                        tuple(r.prompt_token_ids) for r in self.engine.scheduler.running
                    )
                raise InjectedFault("injected model forward failure (soak)")
            return self._execute(batch)

        self.engine.runner.execute = execute
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.runner.execute = self._execute


def _rss_mb() -> float:
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except ImportError:  # pragma: no cover - Linux fallback
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _prompts(seed: int, count: int, first_tokens: range) -> list[list[int]]:
    """Prompts with distinct first tokens (so no two share a first block), 2-5 blocks long."""
    rng = random.Random(seed)
    firsts = rng.sample(list(first_tokens), count)
    return [[f] + [rng.randrange(3, 500) for _ in range(rng.randrange(33, 80))] for f in firsts]


def _malformed(rng: random.Random, key: str) -> tuple[dict[str, Any], Any]:
    """One malformed request: (httpx request kwargs, description)."""
    auth = {"Authorization": f"Bearer {key}"}
    as_json = {**auth, "Content-Type": "application/json"}
    chat = "/v1/chat/completions"
    done = "/v1/completions"
    cases = [
        ("bad-json", done, b'{"prompt": "x",', as_json),
        ("not-object", done, b"[1, 2]", as_json),
        ("prompt-type", done, b'{"prompt": 5}', as_json),
        ("surrogate", done, b'{"prompt": "a\\ud800b", "max_tokens": 1}', as_json),
        ("surrogate-salt", done, b'{"prompt": "ab", "cache_salt": "\\udfff"}', as_json),
        (
            "seed",
            done,
            b'{"prompt": "ab", "temperature": 1, "seed": 18446744073709551616}',
            as_json,
        ),
        ("top-p", done, b'{"prompt": "ab", "top_p": 0}', as_json),
        ("vocab", done, b'{"prompt": [1, 999999]}', as_json),
        ("stops", done, json.dumps({"prompt": "ab", "stop": ["s"] * 100}).encode(), as_json),
        ("messages", chat, b'{"messages": "hi"}', as_json),
        (
            "big-chunk",
            chat,
            json.dumps(
                {
                    "messages": [{"role": "user", "content": "q"}],
                    "ragkv": {"chunks": ["x" * 40_000]},
                }
            ).encode(),
            as_json,
        ),
        ("text-plain", done, b'{"prompt": "ab"}', {**auth, "Content-Type": "text/plain"}),
        ("foreign-host", done, b'{"prompt": "ab"}', {**as_json, "Host": "rebind.evil.example"}),
        ("wrong-key", done, b'{"prompt": "ab"}', {**as_json, "Authorization": "Bearer nope"}),
    ]
    name, path, body, headers = rng.choice(cases)
    return {"url": path, "content": body, "headers": headers}, name


class Soak:
    def __init__(
        self,
        engine: Any,
        base_url: str,
        *,
        seconds: float,
        clients: int,
        max_requests: int,
        injector: FaultInjector,
        references: dict[tuple[int, ...], list[int]],
        valid_prompts: list[list[int]],
        noise_prompts: list[list[int]],
        seed: int,
        mix: dict[str, float],
        blend_groups: list[list[str]] | None = None,
    ) -> None:
        self.engine = engine
        self.blend_groups = blend_groups or []
        self.mix = mix
        self.base_url = base_url
        self.seconds = seconds
        self.clients = clients
        self.max_requests = max_requests
        self.injector = injector
        self.references = references
        self.valid_prompts = valid_prompts
        self.noise_prompts = noise_prompts
        self.rng = random.Random(seed)
        self.report = SoakReport(clients=clients)
        self.five_xx: Counter = Counter()  # prompt -> 5xx answers to valid requests
        self.noise_five_xx: Counter = Counter()  # the same for dropped streams and timeouts
        self.blend_five_xx = 0  # 5xx answers to blend chats
        self.probed: set[tuple[str, int]] = set()
        self.probe_locks: dict[tuple[str, int], asyncio.Lock] = {}
        self.completed_epoch: dict[tuple[str, int], int] = {}  # (tenant, prompt) -> fault count

    def problem(self, text: str) -> None:
        if len(self.report.problems) < 50:
            self.report.problems.append(text)

    async def run(self) -> SoakReport:
        deadline = time.monotonic() + self.seconds
        limits = httpx.Limits(
            max_connections=self.clients * 2, max_keepalive_connections=self.clients
        )
        async with httpx.AsyncClient(base_url=self.base_url, timeout=60, limits=limits) as http:
            await asyncio.gather(*(self.client(http, deadline) for _ in range(self.clients)))
        return self.report

    async def client(self, http: httpx.AsyncClient, deadline: float) -> None:
        while time.monotonic() < deadline and self.report.requests < self.max_requests:
            self.report.requests += 1
            kind = self.rng.choices(list(self.mix), weights=list(self.mix.values()))[0]
            key = self.rng.choice(list(TENANTS))
            if kind == "valid":
                await self.valid(http, key, stream=False)
            elif kind == "valid-stream":
                await self.valid(http, key, stream=True)
            elif kind == "malformed":
                await self.malformed(http, key)
            elif kind == "dropped-stream":
                await self.dropped_stream(http, key)
            elif kind == "blend":
                await self.blend(http, key)
            else:
                await self.client_timeout(http, key)

    # -- valid requests ------------------------------------------------------------------

    async def valid(self, http: httpx.AsyncClient, key: str, *, stream: bool) -> None:
        index = self.rng.randrange(len(self.valid_prompts))
        slot = (TENANTS[key], index)
        if slot not in self.probed:
            lock = self.probe_locks.setdefault(slot, asyncio.Lock())
            async with lock:
                if slot not in self.probed:
                    await self.probe(http, key, index)
                    return
        await self.send_valid(http, key, index, stream=stream)

    async def probe(self, http: httpx.AsyncClient, key: str, index: int) -> None:
        tenant = TENANTS[key]
        epoch = self.injector.injected
        others = any(
            self.completed_epoch.get((t, index)) == epoch for t in TENANTS.values() if t != tenant
        )
        answer = await self.send_valid(http, key, index, stream=False)
        self.probed.add((tenant, index))
        if answer is None:
            # Failed by an injected fault. The pool was flushed, but KV tiers may keep the
            # tenant's own blocks of this prompt: a later request is no clean probe.
            return
        self.report.probes += 1
        self.report.cross_tenant_probes += others
        if answer["usage"]["prompt_tokens_details"]["cached_tokens"] != 0:
            self.report.cross_tenant_hits += 1
            self.problem(f"probe of {tenant} on prompt {index} reused another tenant's blocks")

    async def send_valid(
        self, http: httpx.AsyncClient, key: str, index: int, *, stream: bool
    ) -> dict | None:
        """Send one valid request; return its body (tokens, usage) if answered correctly."""
        prompt = self.valid_prompts[index]
        body = {
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": stream,
            "stream_options": {"include_usage": True} if stream else None,
        }
        headers = {"Authorization": f"Bearer {key}"}
        self.report.valid += 1
        self.report.streamed += stream
        try:
            if stream:
                status, answer = await self._stream(http, body, headers)
            else:
                response = await http.post("/v1/completions", json=body, headers=headers)
                status = response.status_code
                answer = response.json()
                if status == 200:
                    answer["tokens"] = answer["choices"][0]["token_ids"]
        except (httpx.HTTPError, ValueError) as exc:
            self.report.lost += 1
            self.problem(f"valid request failed on the client: {type(exc).__name__}: {exc}")
            return None
        if status >= 500:
            self.five_xx[tuple(prompt)] += 1
            return None
        if status != 200:
            self.report.lost += 1
            self.problem(f"valid request got {status}: {str(answer)[:200]}")
            return None
        if answer["tokens"] != self.references[tuple(prompt)]:
            self.report.mismatches += 1
            self.problem(
                f"prompt {index} ({'stream' if stream else 'plain'}, cached "
                f"{answer['usage']['prompt_tokens_details']['cached_tokens']}): output "
                f"{answer['tokens']} differs from the direct greedy call "
                f"{self.references[tuple(prompt)]}"
            )
            return None
        self.report.valid_ok += 1
        tenant = TENANTS[key]
        if (tenant, index) in self.probed and answer["usage"]["prompt_tokens_details"][
            "cached_tokens"
        ]:
            self.report.same_tenant_cached_hits += 1
        self.completed_epoch[(tenant, index)] = self.injector.injected
        return answer

    async def blend(self, http: httpx.AsyncClient, key: str) -> None:
        """A RAG chat opting into chunk reuse; a (tenant, group)'s first one is a probe."""
        group = self.rng.randrange(len(self.blend_groups))
        chunks = self.rng.sample(self.blend_groups[group], self.rng.randrange(2, 5))
        slot = (TENANTS[key], -1 - group)  # negative: never a valid prompt's index
        if slot not in self.probed:
            async with self.probe_locks.setdefault(slot, asyncio.Lock()):
                if slot not in self.probed:
                    reused = await self.send_blend(http, key, chunks)
                    self.probed.add(slot)
                    if reused is None:  # failed (a fault): the next one is no clean probe
                        return
                    self.report.probes += 1
                    if reused:
                        self.report.cross_tenant_hits += 1
                        self.problem(f"blend probe of {slot[0]}, group {group}: reused {reused}")
                    return
        await self.send_blend(http, key, chunks)

    async def send_blend(self, http: httpx.AsyncClient, key: str, chunks: list[str]) -> int | None:
        """Send one blend chat; its ``reused_nonprefix_tokens`` if answered (None: a 5xx)."""
        body = {
            "messages": [{"role": "user", "content": f"Question {self.rng.randrange(99)}?"}],
            "ragkv": {"chunks": chunks, "system": "Answer from the context.", "reuse": "blend",
                      "k": 4},
            "max_tokens": 4,
            "temperature": 0,
        }  # fmt: skip
        headers = {"Authorization": f"Bearer {key}"}
        try:
            response = await http.post("/v1/chat/completions", json=body, headers=headers)
            answer = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            self.report.lost += 1
            self.problem(f"blend chat failed on the client: {type(exc).__name__}: {exc}")
            return None
        if response.status_code >= 500:  # explained only by an injected fault (run_soak)
            self.blend_five_xx += 1
            return None
        if response.status_code != 200:
            self.report.lost += 1
            self.problem(f"blend chat got {response.status_code}: {str(answer)[:200]}")
            return None
        reused = answer["usage"].get("reused_nonprefix_tokens", 0)
        self.report.blend += 1
        self.report.blend_reused_tokens += reused
        return reused

    async def _stream(self, http: httpx.AsyncClient, body: dict, headers: dict) -> tuple[int, Any]:
        tokens: list[int] = []
        finishes = dones = 0
        usage = error = None
        async with http.stream("POST", "/v1/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                return response.status_code, json.loads(await response.aread())
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    dones += 1
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = event
                elif event.get("usage"):
                    usage = event["usage"]
                else:
                    choice = event["choices"][0]
                    tokens += choice.get("token_ids", [])
                    finishes += choice["finish_reason"] is not None
        if error is not None:
            return (500 if error["error"]["type"] == "server_error" else 400), error
        if finishes != 1 or dones != 1 or usage is None:
            return 0, {"finishes": finishes, "dones": dones, "usage": usage}
        return 200, {"tokens": tokens, "usage": usage}

    # -- noise -----------------------------------------------------------------------------

    async def malformed(self, http: httpx.AsyncClient, key: str) -> None:
        self.report.malformed += 1
        request, name = _malformed(self.rng, key)
        try:
            response = await http.post(**request)
        except httpx.HTTPError as exc:
            self.report.server_errors += 1
            self.problem(f"malformed {name}: {type(exc).__name__}")
            return
        if not 400 <= response.status_code < 500:
            self.report.server_errors += 1
            self.problem(f"malformed {name} got {response.status_code}: {response.text[:200]}")

    def _long_body(self, stream: bool) -> dict:
        return {
            "prompt": self.rng.choice(self.noise_prompts),
            "max_tokens": LONG_MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
        }

    async def dropped_stream(self, http: httpx.AsyncClient, key: str) -> None:
        self.report.dropped_streams += 1
        headers = {"Authorization": f"Bearer {key}"}
        keep = self.rng.randrange(1, 4)
        body = self._long_body(True)
        with contextlib.suppress(httpx.HTTPError):
            async with http.stream(
                "POST", "/v1/completions", json=body, headers=headers
            ) as response:
                if response.status_code >= 500:
                    self.noise_five_xx[tuple(body["prompt"])] += 1
                seen = 0
                async for line in response.aiter_lines():
                    seen += bool(line)
                    if seen >= keep:
                        break  # leaving the block closes the connection mid-stream

    async def client_timeout(self, http: httpx.AsyncClient, key: str) -> None:
        self.report.client_timeouts += 1
        headers = {"Authorization": f"Bearer {key}"}
        timeout = self.rng.uniform(0.02, 0.3)
        body = self._long_body(False)
        # A client that gives up may also see its connection reset; either way it is gone.
        with contextlib.suppress(httpx.TimeoutException, httpx.TransportError):
            response = await http.post(
                "/v1/completions", json=body, headers=headers, timeout=timeout
            )
            if response.status_code >= 500:
                self.noise_five_xx[tuple(body["prompt"])] += 1


def _wait_idle(engine: Any, attempts: int = 1200) -> None:
    for _ in range(attempts):
        stats = engine.stats()
        if stats.num_free_blocks == stats.num_blocks and not engine.scheduler.has_unfinished():
            return
        time.sleep(0.025)


def run_soak(
    engine: Any,
    *,
    seconds: float,
    clients: int,
    fault_rate: float = 0.005,
    max_requests: int = 1_000_000,
    seed: int = 0,
    mix: dict[str, float] | None = None,
    reuse: str | None = None,
) -> SoakReport:
    """Serve ``engine`` on loopback with three tenants and soak it; return the report.

    ``reuse="blend"`` serves with chunk reuse on and adds blend chats to the default mix.
    """
    from ragkv.cache_engine import SamplingParams
    from ragkv.integrations.openai.server.app import create_app
    from ragkv.integrations.openai.server.thread import ServerThread

    valid_prompts = _prompts(seed, VALID_PROMPTS, range(3, 200))
    noise_prompts = _prompts(seed + 1, NOISE_PROMPTS, range(200, 500))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outputs = engine.generate(valid_prompts, [params] * len(valid_prompts))
    references = {tuple(p): o.token_ids for p, o in zip(valid_prompts, outputs, strict=True)}
    app = create_app(engine, api_keys=TENANTS, request_timeout_s=120, reuse=reuse)
    blend_groups = _blend_groups(seed) if reuse == "blend" else None
    if mix is None:
        mix = dict(MIX)
        if blend_groups:
            mix["blend"] = BLEND_SHARE
    rss_before = _rss_mb()
    started = time.monotonic()
    with ServerThread(app) as url, FaultInjector(engine, fault_rate, seed) as injector:
        soak = Soak(
            engine,
            url,
            seconds=seconds,
            clients=clients,
            max_requests=max_requests,
            injector=injector,
            references=references,
            valid_prompts=valid_prompts,
            noise_prompts=noise_prompts,
            seed=seed,
            mix=mix,
            blend_groups=blend_groups,
        )
        report = asyncio.run(soak.run())
        _wait_idle(engine)
    report.seconds = round(time.monotonic() - started, 1)
    report.faults_injected = injector.injected
    for five_xx, valid in ((soak.five_xx, True), (soak.noise_five_xx, False)):
        for prompt, count in five_xx.items():
            explained = min(count, injector.hits[prompt])
            report.requests_failed_by_faults += explained
            report.server_errors += count - explained
            if valid:
                report.lost += count - explained
            if count > explained:
                soak.problem(f"{count - explained} unexplained 5xx on a prompt")
    known = set(references) | {tuple(p) for p in noise_prompts}
    other_hits = sum(n for prompt, n in injector.hits.items() if prompt not in known)
    explained = min(soak.blend_five_xx, other_hits)  # blend chats are assembled server-side
    report.requests_failed_by_faults += explained
    report.server_errors += soak.blend_five_xx - explained
    report.lost += soak.blend_five_xx - explained
    if soak.blend_five_xx > explained:
        soak.problem(f"{soak.blend_five_xx - explained} unexplained 5xx on blend chats")
    stats = engine.stats()
    report.pool_blocks = stats.num_blocks
    report.pool_free_after = stats.num_free_blocks
    report.rss_before_mb = round(rss_before, 1)
    report.rss_after_mb = round(_rss_mb(), 1)
    return report


def _blend_groups(seed: int) -> list[list[str]]:
    """``BLEND_GROUPS`` groups of ``BLEND_GROUP_SIZE`` distinct chunks of 20-40 words."""
    rng = random.Random(seed + 2)
    words = ["cache", "block", "prefix", "token", "model", "river", "stone", "light", "paper",
             "market", "garden", "signal", "window", "orbit", "harbor", "forest", "engine"]  # fmt: skip
    return [
        [
            f"Chunk {g}.{c}: " + " ".join(rng.choice(words) for _ in range(rng.randrange(20, 41)))
            for c in range(BLEND_GROUP_SIZE)
        ]
        for g in range(BLEND_GROUPS)
    ]


def _tiny_checkpoint() -> str:
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from support import save_tiny_checkpoint

    return str(save_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="ragkv-soak-")), seed=7))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--max-requests", type=int, default=1_000_000)
    parser.add_argument("--fault-rate", type=float, default=0.005, help="share of model steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="checkpoint dir (default: embedded)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer random-weight model")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--reuse", choices=("blend",), default=None, help="serve chunk reuse")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import logging

    from ragkv.cache_engine import Engine

    # Injected faults are logged with a traceback each; the report counts them.
    logging.getLogger("ragkv").setLevel(logging.CRITICAL)
    model = _tiny_checkpoint() if args.tiny else args.model
    with Engine.from_pretrained(
        model, device=args.device, kv_cache_tokens=16384, max_model_len=1024
    ) as engine:
        report = run_soak(
            engine,
            seconds=args.seconds,
            clients=args.clients,
            fault_rate=args.fault_rate,
            max_requests=args.max_requests,
            seed=args.seed,
            reuse=args.reuse,
        )
    if args.json:
        print(json.dumps({**asdict(report), "ok": report.ok}, indent=2))
    else:
        for name, value in asdict(report).items():
            if name != "problems":
                print(f"{name:>28}: {value}")
        for text in report.problems:
            print(f"  problem: {text}")
        print("OK" if report.ok else "FAILED")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
