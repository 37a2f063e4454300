"""The benchmark lanes and the replay loop that runs a workload through one of them.

Every lane is a :class:`ragkv.Pipeline` on its own fresh :class:`Engine` (same model,
dtype, block size and KV pool), so all lanes start cold and build prompts with the same
template; they differ only in what the issue's savings stack adds:

============== ================= ============================ ===== ======================
lane           prefix caching    chunk order                  dedup invalidator demotion
============== ================= ============================ ===== ======================
no-cache       off               retrieval                    no    no
apc            on                retrieval                    no    no
apc+assembler  on                stable-first / cache-aware   no    yes
ragkv          on                stable-first / cache-aware   yes   yes
ragkv-batch    on                the batch's shared order     yes   yes
ragkv+tiers    on, + KV tiers    stable-first / cache-aware   yes   yes
============== ================= ============================ ===== ======================

``ragkv-batch`` is the ``ragkv`` lane told the whole workload in advance: it goes through
:meth:`ragkv.Pipeline.answer_batch`, which gives the chunks shared in the workload one order
and runs requests that share a prefix one after another (a session's turns in order), with
the same ``concurrency`` in flight (:mod:`ragkv.batch`). Its requests' arrival order is
the batch's, not the workload's: the per-request timestamp of the synthetic workload's
system prompt still varies per request.

``ragkv+tiers`` (opt-in: name it in ``--lanes``) is the ``ragkv`` lane with the same pool and
KV tiers below it (host memory, and disk with a store directory). With ``--restart`` it
runs twice: the second run, ``ragkv+tiers/restart``, is a new engine on the same store.
``ragkv/unbounded`` (opt-in) is the ``ragkv`` lane with a pool that holds every distinct
block of the workload: what the tiers can at best recover.

``ragkv bench --reuse blend`` adds an opt-in fifth lane, ``ragkv+blend``: the ``ragkv``
lane's own prompts (token ids and chunk spans, the same follow-up histories) replayed on a
fresh engine with position-independent chunk reuse (``BlendConfig()``, deviation with
``ratio=0.15``, unless ``--blend-strategy``, ``--blend-k`` or ``--blend-ratio`` say
otherwise). Its answers are
approximate, so it is left out of the determinism check and compared with ``ragkv``'s
greedy outputs instead.

The replay is a closed loop: at most ``concurrency`` requests in flight, dispatched in
workload order; a follow-up waits until its session's previous turn has answered, because
its history holds that answer (each lane's own answer).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ragkv._sync import run_coroutine
from ragkv.bench.workload import RequestSpec, Workload
from ragkv.errors import ConfigError

T = TypeVar("T")

BATCH_LANE = "ragkv-batch"
LANES = ("no-cache", "apc", "apc+assembler", "ragkv", BATCH_LANE)
BLEND_LANE = "ragkv+blend"  # opt-in (--reuse blend): replays the ragkv lane's prompts
TIERS_LANE = "ragkv+tiers"
RESTART_LANE = "ragkv+tiers/restart"
UNBOUNDED_LANE = "ragkv/unbounded"
ALL_LANES = (*LANES, TIERS_LANE, UNBOUNDED_LANE)


@dataclass(frozen=True, slots=True)
class LaneSpec:
    """What one lane switches on."""

    name: str
    prefix_caching: bool
    order: str
    dedup: bool
    demote_invalidators: bool
    tiers: bool = False  # KV tiers below the pool (host memory, disk)
    unbounded_pool: bool = False  # a pool that holds every distinct block (a reference)
    reuse: bool = False  # position-independent chunk reuse (approximate)
    batch: bool = False  # the whole workload as one batch (Pipeline.answer_batch)


def lane_specs(names: Sequence[str] = LANES, order: str = "cache-aware") -> list[LaneSpec]:
    """Specs of the named lanes; ``order`` is the assembler order of the last two."""
    table = {
        "no-cache": LaneSpec("no-cache", False, "retrieval", False, False),
        "apc": LaneSpec("apc", True, "retrieval", False, False),
        "apc+assembler": LaneSpec("apc+assembler", True, order, False, True),
        "ragkv": LaneSpec("ragkv", True, order, True, True),
        BATCH_LANE: LaneSpec(BATCH_LANE, True, order, True, True, batch=True),
        TIERS_LANE: LaneSpec(TIERS_LANE, True, order, True, True, tiers=True),
        RESTART_LANE: LaneSpec(RESTART_LANE, True, order, True, True, tiers=True),
        UNBOUNDED_LANE: LaneSpec(UNBOUNDED_LANE, True, order, True, True, unbounded_pool=True),
        BLEND_LANE: LaneSpec(BLEND_LANE, True, order, True, True, reuse=True),
    }
    unknown = [n for n in names if n not in table]
    if unknown or not names:
        raise ConfigError(
            f"unknown lane(s) {unknown}; choose from {', '.join((*ALL_LANES, BLEND_LANE))}"
        )
    return [table[n] for n in names]


@dataclass(slots=True)
class RequestRecord:
    """What one request cost in one lane."""

    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    dedup_removed_tokens: int
    ttft_s: float  # dedup + assembly + engine time to first token
    e2e_s: float  # dedup + assembly + engine total
    chunks_in: int
    chunks_out: int
    reused_nonprefix_tokens: int = 0
    reused_approximate_prefix_tokens: int = 0


@dataclass(slots=True)
class LaneResult:
    """All records of one lane, the engine's counters at the end and the wall time."""

    spec: LaneSpec
    records: list[RequestRecord]
    stats: Any  # EngineStats
    wall_s: float
    load_s: float
    kv_cache_tokens: int
    answers: list[Any] = field(default_factory=list)  # Answer objects, when kept
    sessions: dict[int, str] = field(default_factory=dict)  # request index -> session id


def build_pipeline(spec: LaneSpec, engine: Any) -> Any:
    """The lane's pipeline; only the dedup stage removes duplicates (lanes without it keep them)."""
    from ragkv.assembler import Assembler, AssemblerConfig
    from ragkv.pipeline import Pipeline

    config = AssemblerConfig(
        block_size=engine.block_size,
        order=spec.order,
        demote_invalidators=spec.demote_invalidators,
        collapse_duplicates=False,
        # The baselines send the app's own order; only ragkv's lanes compare against it.
        never_worse=spec.demote_invalidators,
    )
    if not spec.demote_invalidators:
        # Baselines model an app without ragkv's assembler: no invalidator warning either.
        config = config.replace(invalidator_after=1 << 30)
    assembler = Assembler(engine.tokenizer, config=config)
    # Every lane sends every retrieved chunk: a budget would drop different chunks per lane.
    return Pipeline(engine, assembler=assembler, dedup=spec.dedup, fit_context=False)


def run_lane(
    spec: LaneSpec,
    workload: Workload,
    make_engine: Callable[[LaneSpec], Any],
    params: Any,
    *,
    concurrency: int = 8,
    progress: bool = False,
    keep_answers: bool = False,
) -> LaneResult:
    """Replay ``workload`` through a fresh engine from ``make_engine(spec)``."""
    if concurrency < 1:
        raise ConfigError(f"concurrency must be >= 1, got {concurrency}")
    with _fresh_engine(spec, make_engine) as run:
        pipeline = build_pipeline(spec, run.engine)
        bar = _progress(len(workload.requests), spec.name, progress)
        t0 = time.perf_counter()
        if spec.batch:
            answers = _run_batch(pipeline, workload.requests, params, concurrency, bar)
        else:
            answers = run_coroutine(_replay(pipeline, workload.requests, params, concurrency, bar))
        run.wall_s = time.perf_counter() - t0
        if bar is not None:
            bar.close()
    records = [
        _record(spec, pipeline, request, answer)
        for request, answer in zip(workload.requests, answers, strict=True)
    ]
    sessions = {r.index: r.session_id for r in workload.requests}
    return LaneResult(
        spec, records, run.stats, run.wall_s, run.load_s, run.kv_tokens,
        answers if keep_answers else [], sessions,
    )  # fmt: skip


def run_blend_lane(
    spec: LaneSpec,
    exact: LaneResult,
    make_engine: Callable[[LaneSpec], Any],
    params: Any,
    *,
    concurrency: int = 8,
    blend: Any = None,
) -> LaneResult:
    """Replay the exact ``ragkv`` lane's prompts (kept answers) with chunk reuse on
    (``blend``: a :class:`~ragkv.cache_engine.chunk_reuse.BlendConfig`, default its default)."""
    from ragkv.cache_engine.chunk_reuse import BlendConfig

    blend = blend or BlendConfig()
    with _fresh_engine(spec, make_engine) as run:
        t0 = time.perf_counter()
        outputs = run_coroutine(_replay_plans(run.engine, exact, params, blend, concurrency))
        run.wall_s = time.perf_counter() - t0
    records = []
    for base, answer, output in zip(exact.records, exact.answers, outputs, strict=True):
        prep = answer.timings["dedup_s"] + answer.timings["assemble_s"]
        t = output.timings
        records.append(
            dataclasses.replace(
                base,
                token_ids=output.token_ids,
                text=output.text,
                cached_tokens=output.usage.cached_tokens,
                completion_tokens=output.usage.completion_tokens,
                ttft_s=prep + t.ttft_s,
                e2e_s=prep + t.total_s,
                reused_nonprefix_tokens=output.usage.reused_nonprefix_tokens,
                reused_approximate_prefix_tokens=output.usage.reused_approximate_prefix_tokens,
            )
        )
    return LaneResult(spec, records, run.stats, run.wall_s, run.load_s, run.kv_tokens)


@dataclass(slots=True)
class _EngineRun:
    """A lane's engine and what the lane reports of it: load and replay seconds (the lane
    times its replay), and the counters and KV size read before it closed."""

    engine: Any
    load_s: float
    wall_s: float = 0.0
    stats: Any = None  # EngineStats
    kv_tokens: int = 0


@contextmanager
def _fresh_engine(spec: LaneSpec, make_engine: Callable[[LaneSpec], Any]) -> Iterator[_EngineRun]:
    """A fresh engine from ``make_engine(spec)``, its load timed; closed on exit, after its
    stats are read (unless the lane failed)."""
    started = time.perf_counter()
    engine = make_engine(spec)
    run = _EngineRun(engine, time.perf_counter() - started)
    try:
        yield run
        run.stats = engine.stats()
        run.kv_tokens = engine.kv_cache_tokens
    finally:
        engine.close()


async def _replay_plans(
    engine: Any, exact: LaneResult, params: Any, blend: Any, concurrency: int
) -> list[Any]:
    """The exact lane's plans in workload order, a session's turns one after another."""

    async def one(pair: tuple[Any, RequestRecord]) -> Any:
        plan = pair[0].plan
        spans = [(s.start, s.end) for s in plan.spans("chunk")]
        return await engine.agenerate(plan.token_ids, params, chunk_spans=spans, reuse=blend)

    def session(pair: tuple[Any, RequestRecord]) -> str:
        index = pair[1].index
        return exact.sessions[index] if exact.sessions else str(index)

    pairs = list(zip(exact.answers, exact.records, strict=True))
    return await _in_session_order(pairs, session, one, concurrency)


def _run_batch(
    pipeline: Any, requests: Sequence[RequestSpec], params: Any, concurrency: int, bar: Any
) -> list[Any]:
    """The workload as one batch: a follow-up's history is its session's earlier answers."""
    from ragkv.batch import BatchItem

    items = [
        BatchItem(r.question, r.chunks, system=r.system, history=r.history, session=r.session_id)
        for r in requests
    ]
    answers = []
    for answer in pipeline.stream_batch(
        items, params=params, max_in_flight=concurrency, window=max(1, len(items))
    ):
        answers.append(answer)
        if bar is not None:
            bar.update(1)
    return answers


async def _replay(
    pipeline: Any, requests: Sequence[RequestSpec], params: Any, concurrency: int, bar: Any
) -> list[Any]:
    turns: dict[str, list[dict[str, str]]] = defaultdict(list)
    # Prompts are assembled one at a time in arrival (workload) order: the assembler learns
    # its chunk order from the requests it has seen, and worker threads racing to assemble
    # would make a lane's prompts depend on scheduling, so two lanes would not replay the
    # same prompts. Generation still runs ``concurrency`` at once.
    assembled = [asyncio.Event() for _ in requests]

    async def one(item: tuple[int, RequestSpec]) -> Any:
        i, spec = item
        try:
            if i:
                await assembled[i - 1].wait()
            history = spec.history if spec.history is not None else list(turns[spec.session_id])
            prepared = await asyncio.to_thread(
                pipeline.prepare,
                spec.question,
                spec.chunks,
                system=spec.system,
                history=history,
                params=params,
            )
        finally:
            assembled[i].set()
        answer = await pipeline.agenerate_prepared(prepared, params)
        turns[spec.session_id] += [
            {"role": "user", "content": spec.question},
            {"role": "assistant", "content": answer.text},
        ]
        if bar is not None:
            bar.update(1)
        return answer

    items = list(enumerate(requests))
    return await _in_session_order(items, lambda item: item[1].session_id, one, concurrency)


async def _in_session_order(
    items: Sequence[T],
    session: Callable[[T], str],
    run: Callable[[T], Awaitable[Any]],
    concurrency: int,
) -> list[Any]:
    """``run(item)`` for every item, in order, at most ``concurrency`` at once, a session's
    items one after another (a follow-up's history is its session's earlier answers); the
    results in order. A failure cancels the rest, which aborts their requests in the engine."""
    slots = asyncio.Semaphore(concurrency)
    last: dict[str, asyncio.Task[Any]] = {}
    tasks: list[asyncio.Task[Any]] = []

    async def one(item: T) -> Any:
        try:
            return await run(item)
        finally:
            slots.release()

    try:
        for item in items:
            key = session(item)
            previous = last.get(key)
            if previous is not None:
                await previous  # its answer may be part of this item's history
            await slots.acquire()
            last[key] = task = asyncio.create_task(one(item))
            tasks.append(task)
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _record(spec: LaneSpec, pipeline: Any, request: RequestSpec, answer: Any) -> RequestRecord:
    t = answer.timings
    prep = t["dedup_s"] + t["assemble_s"]
    usage = answer.usage
    return RequestRecord(
        index=request.index,
        prompt_token_ids=answer.output.prompt_token_ids,
        token_ids=answer.output.token_ids,
        text=answer.text,
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=usage.cached_tokens,
        completion_tokens=usage.completion_tokens,
        dedup_removed_tokens=removed_tokens(pipeline, request, answer.plan) if spec.dedup else 0,
        ttft_s=prep + t["ttft_s"],
        e2e_s=prep + t["total_s"],
        chunks_in=answer.dedup.chunks_in,
        chunks_out=answer.dedup.chunks_out,
        reused_nonprefix_tokens=usage.reused_nonprefix_tokens,
        reused_approximate_prefix_tokens=usage.reused_approximate_prefix_tokens,
    )


def removed_tokens(pipeline: Any, request: RequestSpec, plan: Any) -> int:
    """Tokens the duplicates would have added: each is as long as its survivor's span."""
    lengths = {s.content_hash: s.end - s.start for s in plan.spans("chunk")}
    key = pipeline.registry.key
    retrieved = sum(lengths.get(key(c), 0) for c in request.chunks)
    kept = sum(lengths.values())
    delimiter = len(pipeline.assembler.template.chunk_delimiter.token_ids)
    return retrieved - kept + delimiter * (len(request.chunks) - len(lengths))


def _progress(total: int, name: str, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=f"{name:>13}", unit="req", leave=False)
