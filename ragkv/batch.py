"""Batch jobs: a set of requests known in advance, run in an order that reuses the most.

An evaluation over a question set, bulk document Q&A, a notebook sweep: when every request
is known before the first runs, the order they run in is free, and so is the order their
chunks go in. :meth:`ragkv.Pipeline.answer_batch` takes the items a window at a time
(``window``, 1,024 by default, so a 100k-item batch never holds more than one window's
chunks, and no more prompts' token ids than are in flight) and per window:

1. dedups every item's chunks and counts, over the window, how many items hold each chunk;
2. gives the chunks held by two items or more **one shared order**, most shared first (ties
   by first appearance), so two items with the same hot chunks send them as the same
   prefix (chunks held by one item go after, as volatile content does);
3. **orders the items** by tenant (cache salt), system prompt and then their chunks in that
   shared order, compared lexicographically: a depth-first walk of the prefix tree of the
   planned chunk orders, so items that share a prefix run one after another while it is
   still in the KV pool. A session's turns keep their order (each waits for the one before,
   whose answer is in its history);
4. assembles and submits the items in that order with ``max_in_flight`` in the engine at
   once, and returns the answers in the caller's order.

What the engine does with a contended pool is its scheduler's policy
(``EngineConfig.schedule_policy``): ``"fcfs"`` admits in submission order, which is the
order above; ``"longest-prefix"`` admits the waiting request with the longest cached
prefix first. ``ragkv bench`` measures both (docs/benchmarks.md).

Answers do not depend on the schedule: each is the engine's exact answer to its own prompt
(``answer.prompt_text``), whatever ran beside it. The chunk order a prompt gets does
depend on the window it was planned in, as the learned order depends on earlier traffic.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections import Counter
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Hashable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
    Sized,
)
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ragkv._sync import run_coroutine
from ragkv.assembler.structured import SystemLike, system_parts
from ragkv.cache_engine.sampling_params import SamplingParams
from ragkv.errors import InvalidInputError, RagkvError

if TYPE_CHECKING:
    from ragkv.pipeline import Pipeline

DEFAULT_WINDOW = 1024

Turn = Mapping[str, str]


@dataclass(frozen=True, slots=True)
class BatchItem:
    """One request of a batch: what :meth:`ragkv.Pipeline.answer` takes, plus ``session``.

    Items of one ``session`` are turns of one conversation. A turn without ``history`` gets
    the session's earlier turns of this batch (questions and their answers) as its history,
    so it runs after them; a turn with its own ``history`` runs whenever it fits best.
    """

    question: str
    chunks: Sequence[Any] = ()
    system: SystemLike | None = None
    history: Sequence[Turn] | None = None
    session: Hashable | None = None
    cache_salt: str | None = None


_FIELDS = frozenset(BatchItem.__dataclass_fields__)


def batch_item(item: Any, index: int = 0) -> BatchItem:
    """``item`` as a :class:`BatchItem`: one already, a mapping of its fields, or a question."""
    if isinstance(item, BatchItem):
        checked = item
    elif isinstance(item, str):
        checked = BatchItem(item)
    elif isinstance(item, Mapping):
        unknown = sorted(set(item) - _FIELDS)
        if unknown:
            raise InvalidInputError(
                f"batch item {index} has unknown field(s) {unknown}; use {sorted(_FIELDS)}",
                param=f"items[{index}]",
            )
        if "question" not in item:
            raise InvalidInputError(
                f"batch item {index} has no question", param=f"items[{index}].question"
            )
        checked = BatchItem(**item)
    else:
        raise InvalidInputError(
            f"batch item {index} must be a BatchItem, a mapping or a question string, got "
            f"{type(item).__name__}",
            param=f"items[{index}]",
        )
    if not isinstance(checked.question, str):
        raise InvalidInputError(
            f"batch item {index}: question must be str, got {type(checked.question).__name__}",
            param=f"items[{index}].question",
        )
    if isinstance(checked.chunks, str | bytes):
        raise InvalidInputError(
            f"batch item {index}: chunks must be a list of chunks, got one "
            f"{type(checked.chunks).__name__}; wrap it: [text]",
            param=f"items[{index}].chunks",
        )
    if checked.session is not None:
        try:
            hash(checked.session)
        except TypeError:
            raise InvalidInputError(
                f"batch item {index}: session must be hashable (a str or an int)",
                param=f"items[{index}].session",
            ) from None
    return checked


def windows(items: Iterable[Any], size: int) -> Iterator[list[BatchItem]]:
    """``items`` as validated :class:`BatchItem` lists of at most ``size``, read lazily."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise InvalidInputError(f"window must be an int >= 1, got {size!r}", param="window")
    if isinstance(items, str | bytes | Mapping):
        raise InvalidInputError(
            "items must be a list of batch items (BatchItem, mappings or questions), got one "
            f"{type(items).__name__}",
            param="items",
        )
    counter = itertools.count()
    iterator = iter(items)
    while True:
        window = [batch_item(item, next(counter)) for item in itertools.islice(iterator, size)]
        if not window:
            return
        yield window


def plan_window(
    chunk_keys: Sequence[Sequence[bytes]],
    heads: Sequence[Hashable],
    tails: Sequence[tuple[str, ...]] | None = None,
) -> tuple[list[int], list[dict[bytes, int]]]:
    """The order to run a window's items in, and each item's chunk order (key → rank).

    Items group by ``heads[i]`` (what precedes the chunks: salt, system prompt), in order of
    first appearance. Within a group, a prefix tree is built greedily: at each node, a
    chunk held by several items of the node becomes the next chunk of all of them, which
    form its subtree; the others stay at the node, for its next child. The chunk is the one
    whose subtree shares the most at its first two levels (:func:`_next_chunk`).
    A chunk held by one item of a node ends that item's path; the rank map names only the
    path (the assembler places the other chunks after it, in its learned order). At a
    leaf, items whose path holds all their chunks come first, sorted by ``tails[i]`` (what
    follows the chunks: the history turns), so turns sharing a history prefix run together. Running the items depth-first, each runs right after the
    items it shares the longest chunk prefix with.
    """
    first: dict[bytes, int] = {}
    for keys in chunk_keys:
        for key in keys:
            first.setdefault(key, len(first))
    groups: dict[Hashable, list[int]] = {}
    for i, head in enumerate(heads):
        groups.setdefault(head, []).append(i)
    order: list[int] = []
    paths: list[list[bytes]] = [[] for _ in chunk_keys]
    sets = [set(keys) for keys in chunk_keys]
    # (items, depth): items that share a path of ``depth`` chunks, still to place.
    stack = [(members, 0) for members in reversed(groups.values())]
    while stack:
        members, depth = stack.pop()
        counts = Counter(key for i in members for key in sets[i] if key not in paths[i][:depth])
        best = _next_chunk(counts, members, sets, paths[members[0]][:depth], first)
        if best is None:  # leaves: no chunk is shared below this node
            order.extend(sorted(members, key=lambda i: (
                len(sets[i]) > len(paths[i]), tails[i] if tails else (), i)))  # fmt: skip
            continue
        inside = [i for i in members if best in sets[i]]
        outside = [i for i in members if best not in sets[i]]
        for i in inside:
            paths[i].append(best)
        if outside:
            stack.append((outside, depth))  # the node's next child, after this subtree
        stack.append((inside, depth + 1))
    return order, [{key: r for r, key in enumerate(path)} for path in paths]


# Candidates scored per tree node (the most frequent); the score looks one level deeper.
_CANDIDATES = 16


def _next_chunk(
    counts: Counter[bytes],
    members: Sequence[int],
    sets: Sequence[set[bytes]],
    path: Sequence[bytes],
    first: Mapping[bytes, int],
) -> bytes | None:
    """The node's next chunk, or None when no chunk is held by two of its items.

    Counting alone picks a chunk that many unrelated items hold (a generic passage) over
    the passages of one topic, which hold together for several levels; so each candidate
    scores the items sharing it plus the items sharing its best second chunk.
    """
    taken = set(path)
    shared = [k for k, n in counts.most_common(_CANDIDATES) if n > 1]
    if not shared:
        return None

    def score(key: bytes) -> tuple[int, int]:
        pairs = Counter(
            other for i in members if key in sets[i] for other in sets[i]
            if other != key and other not in taken
        )  # fmt: skip
        deeper = max(pairs.values(), default=1)
        return counts[key] - 1 + deeper - 1, -first[key]

    return max(shared, key=score)


def prefix_leaders(
    order: Sequence[int], ranks: Sequence[Mapping[bytes, int]], heads: Sequence[Hashable]
) -> dict[int, int]:
    """For each item, the item just before it in ``order`` whose chunk order starts the same
    way (same head, same first chunk), if any.

    Run together, two such items would both compute the shared prefix: an engine step
    computes a prompt's blocks before they can be found in the cache. So an item waits for
    its leader's prefill (its first token) before it is submitted; items of other subtrees
    run meanwhile.
    """
    leaders: dict[int, int] = {}
    previous: int | None = None
    for i in order:
        first = _first(ranks[i])
        if (
            previous is not None
            and first is not None
            and heads[i] == heads[previous]
            and first == _first(ranks[previous])
        ):
            leaders[i] = previous
        previous = i
    return leaders


def _first(rank: Mapping[bytes, int]) -> bytes | None:
    return min(rank, key=rank.__getitem__, default=None)


def keep_turn_order(order: Sequence[int], sessions: Sequence[Hashable | None]) -> list[int]:
    """``order`` with each session's items in their own order: a turn whose earlier turn is
    still to run waits for it, and then runs right after it (its answer is this turn's
    history)."""
    waiting: dict[Hashable, list[int]] = {}
    for i in sorted(i for i in order if sessions[i] is not None):
        waiting.setdefault(sessions[i], []).append(i)
    out: list[int] = []
    done: set[int] = set()
    held: dict[int, int] = {}  # earlier turn -> the turn waiting for it

    def emit(i: int) -> None:
        while True:
            out.append(i)
            done.add(i)
            nxt = held.pop(i, None)
            if nxt is None:
                return
            i = nxt

    for i in order:
        session = sessions[i]
        if session is None:
            emit(i)
            continue
        turns = waiting[session]
        before = turns[turns.index(i) - 1] if turns.index(i) > 0 else None
        if before is None or before in done:
            emit(i)
        else:
            held[before] = i
    return out


class TurnSkippedError(RagkvError):
    """A session's turn was not run: the turn before it failed (its answer is this turn's
    history)."""


async def gather_in_order(
    jobs: Sequence[Callable[[], Awaitable[Any]]],
    order: Sequence[int],
    sessions: Sequence[Hashable | None],
    limit: int,
    *,
    fail_fast: bool,
    waits: Mapping[int, asyncio.Event] | None = None,
) -> list[Any]:
    """Run ``jobs[i]()`` in ``order``, at most ``limit`` at once, each session's jobs one
    after another; results by index. A job's exception is its result, unless ``fail_fast``:
    then the first one cancels the rest and is raised. Job ``i`` with ``waits[i]`` waits for
    that event (set by a job earlier in ``order``) before it takes a slot."""
    waits = waits or {}
    slots = asyncio.Semaphore(limit)
    results: list[Any] = [None] * len(jobs)
    last: dict[Hashable, tuple[int, asyncio.Task[Any]]] = {}

    async def one(i: int, after: tuple[int, asyncio.Task[Any]] | None) -> None:
        if after is not None:
            await asyncio.wait([after[1]])
            if isinstance(results[after[0]], BaseException):
                results[i] = TurnSkippedError(
                    f"not run: the turn before it (item {after[0]}) failed: {results[after[0]]}"
                )
                return
        if i in waits:
            await waits[i].wait()
        async with slots:
            try:
                results[i] = await jobs[i]()
            except Exception as exc:
                if fail_fast:
                    raise
                results[i] = exc  # one item's failure is that item's result

    tasks = []
    for i in order:
        session = sessions[i]
        task = asyncio.ensure_future(one(i, last.get(session) if session is not None else None))
        if session is not None:
            last[session] = (i, task)
        tasks.append(task)
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()  # cancelling aborts the request in the engine
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return results


async def answer_window(
    pipeline: Pipeline,
    window: Sequence[BatchItem],
    params: SamplingParams,
    *,
    limit: int,
    fail_fast: bool,
    turns: dict[Hashable, list[dict[str, str]]],
    bar: Any = None,
) -> list[Any]:
    """Plan, order and answer one window; answers (or exceptions) in the window's order.
    ``turns`` carries each session's questions and answers across windows."""
    keys = await asyncio.to_thread(_plan_inputs, pipeline, window)
    heads = [(item.cache_salt or "", _system_key(item.system)) for item in window]
    # Only a turn that takes its history from the batch must wait for the turn before it.
    sessions = [item.session if item.history is None else None for item in window]
    tails = [_history_key(item.history) for item in window]
    order, ranks = plan_window(keys, heads, tails)
    order = keep_turn_order(order, sessions)
    leaders = prefix_leaders(order, ranks, heads)
    del keys
    prefilled = [asyncio.Event() for _ in window]

    async def job(i: int) -> Any:
        item = window[i]
        history = item.history
        if history is None and item.session is not None:
            history = list(turns.get(item.session, ()))
        prepared = await asyncio.to_thread(
            pipeline.prepare, item.question, item.chunks, system=item.system, history=history,
            cache_salt=item.cache_salt, params=params, chunk_order=ranks[i], learn=False,
        )  # fmt: skip
        answer = None
        try:
            async for delta in pipeline.astream_prepared(
                prepared, params, cache_salt=item.cache_salt
            ):
                prefilled[i].set()
                answer = delta.answer or answer
        finally:
            prefilled[i].set()  # failed or cancelled: nobody waits for it
        if item.session is not None:
            turns.setdefault(item.session, []).extend(
                [{"role": "user", "content": item.question},
                 {"role": "assistant", "content": answer.text}]
            )  # fmt: skip
        if bar is not None:
            bar.update(1)
        return answer

    jobs = [functools.partial(job, i) for i in range(len(window))]
    waits = {i: prefilled[leader] for i, leader in leaders.items()}
    return await gather_in_order(jobs, order, sessions, limit, fail_fast=fail_fast, waits=waits)


def _plan_inputs(pipeline: Pipeline, window: Sequence[BatchItem]) -> list[list[bytes]]:
    """Content keys of each item's chunks as the assembler will see them (after dedup).

    Also teaches each namespace's system-prompt learner the window's system prompts in the
    caller's order: run in the batch's order, identical versions come together and the
    learner would take a changing part (a date) for a stable one.
    """
    systems: dict[str | None, list[Any]] = {}
    for item in window:
        systems.setdefault(item.cache_salt, []).append(item.system)
    for salt, versions in systems.items():
        pipeline.assembler_for(salt).learn_system(versions)
    key = pipeline.registry.key
    return [[key(chunk) for chunk in pipeline.dedupe(item.chunks).chunks] for item in window]


def _history_key(history: Sequence[Turn] | None) -> tuple[str, ...]:
    if not history:
        return ()
    return tuple(f"{turn.get('role', '')}:{turn.get('content', '')}" for turn in history)


def _system_key(system: SystemLike | None) -> str:
    """What groups items by system prompt: its opening (a template's first sentence), not
    the whole text, which often holds a date or a user's name that changes every time."""
    parts = system_parts(system)
    if not parts:
        return ""
    first = parts[0]
    return (first if isinstance(first, str) else first.text)[:_HEAD_CHARS]


_HEAD_CHARS = 64  # about one 16-token block


@dataclass(frozen=True, slots=True)
class BatchRun:
    """How a batch runs: what :meth:`ragkv.Pipeline.stream_batch` was asked for."""

    params: SamplingParams
    window: int = DEFAULT_WINDOW
    max_in_flight: int = 16
    progress: bool = False
    return_exceptions: bool = False


def _window_jobs(pipeline: Pipeline, items: Iterable[Any], run: BatchRun) -> Iterator[Any]:
    """One coroutine per window (answers in the window's order), made when the previous
    window is done: the sync and async forms run them on their own loops or the caller's."""
    _check_limit(run.max_in_flight)
    turns: dict[Hashable, list[dict[str, str]]] = {}
    bar = _progress(items, run.progress)
    try:
        for part in windows(items, run.window):
            yield answer_window(
                pipeline, part, run.params, limit=run.max_in_flight,
                fail_fast=not run.return_exceptions, turns=turns, bar=bar,
            )  # fmt: skip
    finally:
        if bar is not None:
            bar.close()


async def astream(pipeline: Pipeline, items: Iterable[Any], run: BatchRun) -> AsyncIterator[Any]:
    """Answers of ``items`` in the caller's order, a window at a time."""
    for job in _window_jobs(pipeline, items, run):
        for result in await job:
            yield result


def stream(pipeline: Pipeline, items: Iterable[Any], run: BatchRun) -> Iterator[Any]:
    """The blocking form of :func:`astream`: each window runs on an event loop of its own
    (on a worker thread when the caller already runs one, as Jupyter does)."""
    for job in _window_jobs(pipeline, items, run):
        yield from run_coroutine(job)


def _check_limit(max_in_flight: Any) -> None:
    if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
        raise InvalidInputError(
            f"max_in_flight must be an int >= 1, got {max_in_flight!r}", param="max_in_flight"
        )


def _progress(items: Iterable[Any], enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    total = len(items) if isinstance(items, Sized) else None
    return tqdm(total=total, desc="batch", unit="req")
