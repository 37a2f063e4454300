"""Batch jobs: a set of requests known in advance, run in an order that reuses the most.

An evaluation over a question set, bulk document Q&A, a notebook sweep: when every request
is known before the first runs, the order they run in is free, and so is the order their
chunks go in. :meth:`ragkv.Pipeline.answer_batch` takes the items a window at a time
(``window``, 1,024 by default, so a 100k-item batch never holds more than one window's
chunks, and no more prompts' token ids than are in flight) and per window:

1. dedups every item's chunks (content keys as the assembler will see them) and teaches
   the system-prompt learner the window's system prompts in the caller's order;
2. plans (:mod:`ragkv.batch_plan`): items group by tenant (cache salt) and system-prompt
   opening; within a group a prefix tree of their chunk sets, built greedily, gives each
   item its **shared path** (the chunks it shares with other items, in one order, first in
   its prompt; the rest follow in the assembler's learned order), and the items run
   depth-first, so those sharing a prefix run one after another while it is in the pool;
3. runs them in that order with at most ``max_in_flight`` in the engine: an item waits for
   the prefill of the item before it in its subtree (run in one step, both would compute
   the shared prefix) and no later item passes it (:func:`gather_in_order` says why), and
   a session's turns that take their history from the batch run in order (a failed turn
   skips the ones after it);
4. assembles each item just before it is submitted (residency then is current: the tree
   walk over orders already sent stays a candidate) and returns answers in the caller's
   order.

What the engine does with a contended pool is its scheduler's policy
(``EngineConfig.schedule_policy``): ``"fcfs"`` admits in submission order, which is the
order above; ``"longest-prefix"`` admits the waiting request with the longest cached
prefix first. ``ragkv bench --schedule-policy`` measures both (docs/benchmarks.md).

Answers do not depend on the schedule: each is the engine's exact answer to its own prompt
(``answer.prompt_text``), whatever ran beside it. The chunk order a prompt gets does
depend on the window it was planned in, as the learned order depends on earlier traffic.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import itertools
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
from ragkv.batch_plan import keep_turn_order, plan_window, prefix_leaders
from ragkv.cache_engine.sampling_params import SamplingParams
from ragkv.dedup import DedupResult
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


class TurnSkippedError(RagkvError):
    """A session's turn was not run: the turn before it failed (its answer is this turn's
    history)."""


async def gather_in_order(
    jobs: Sequence[Callable[[Callable[[], None]], Awaitable[Any]]],
    order: Sequence[int],
    sessions: Sequence[Hashable | None],
    limit: int,
    *,
    fail_fast: bool,
    leaders: Mapping[int, int] | None = None,
) -> list[Any]:
    """Run ``jobs[i](prefilled)`` in ``order``, at most ``limit`` at once; results by index.

    Job ``i`` starts once the job before it in its session has finished and, if
    ``leaders[i]`` names one, once that job has called its ``prefilled()`` (or finished);
    and never before a job ahead of it in ``order``, except one waiting for its session's
    previous turn (that wait is a whole answer long). A job's exception is its result (the
    session's later turns are skipped with :class:`TurnSkippedError`), unless ``fail_fast``:
    then the first one cancels the rest and is raised.

    Why nothing passes a job waiting for its leader: the jobs after it belong to other
    subtrees of the plan. Started early, they fill the pool with their prefixes while the
    waiting job's subtree still needs its own, and their leaders' prefixes wait, unpinned,
    until the earlier subtrees are done: an LRU pool evicts them first. In the plan's order
    only one subtree prefills at a time (its finished jobs' blocks are the newest), and the
    ``limit`` jobs in flight are mostly decoding.
    """
    run = _Dispatch(jobs, order, sessions, limit, fail_fast, leaders or {})
    run.dispatch()
    try:
        if order:
            await run.finished
    except BaseException:
        run.closed = True
        for task in list(run.tasks):
            task.cancel()  # cancelling aborts the request in the engine
        await asyncio.gather(*run.tasks, return_exceptions=True)
        raise
    return run.results


class _Dispatch:
    """The state of :func:`gather_in_order`: which jobs may start, and the free slots.

    ``head`` is the first position of ``order`` not started and not waiting for its
    session's previous turn; ``ready`` holds (as a heap) the positions of jobs whose
    dependencies are met. A slot goes to ``ready[0]`` only when it is ``head``."""

    def __init__(
        self,
        jobs: Sequence[Callable[[Callable[[], None]], Awaitable[Any]]],
        order: Sequence[int],
        sessions: Sequence[Hashable | None],
        limit: int,
        fail_fast: bool,
        leaders: Mapping[int, int],
    ) -> None:
        self.jobs, self.order, self.fail_fast = jobs, order, fail_fast
        self.position = {i: p for p, i in enumerate(order)}
        self.results: list[Any] = [None] * len(jobs)
        self.blockers = dict.fromkeys(order, 0)  # unmet dependencies per job
        self.followers: dict[int, list[int]] = {}  # leader -> jobs waiting for its prefill
        self.next_turn: dict[int, int] = {}  # a session's turn -> the turn after it
        self.turn_pending: set[int] = set()  # positions waiting for their previous turn
        last_turn: dict[Hashable, int] = {}
        for i in order:
            if i in leaders:
                self.blockers[i] += 1
                self.followers.setdefault(leaders[i], []).append(i)
            session = sessions[i]
            if session is not None:
                if session in last_turn:
                    self.next_turn[last_turn[session]] = i
                    self.blockers[i] += 1
                    self.turn_pending.add(self.position[i])
                last_turn[session] = i
        self.ready = [self.position[i] for i in order if not self.blockers[i]]
        heapq.heapify(self.ready)
        self.begun = [False] * len(order)
        self.head = 0
        self.free = limit
        self.left = len(order)
        self.closed = False
        self.finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.tasks: set[asyncio.Task[Any]] = set()

    def dispatch(self) -> None:
        while self.free and self.ready and not self.closed:
            self._advance()
            if self.ready[0] != self.head:
                return  # the job at the head waits for its leader's prefill
            position = heapq.heappop(self.ready)
            self.begun[position] = True
            self.free -= 1
            task = asyncio.ensure_future(self._run(self.order[position]))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def _advance(self) -> None:
        n = len(self.order)
        while self.head < n and (self.begun[self.head] or self.head in self.turn_pending):
            self.head += 1

    async def _run(self, i: int) -> None:
        try:
            self.results[i] = await self.jobs[i](functools.partial(self._prefilled, i))
        except Exception as exc:
            if self.fail_fast:
                if not self.finished.done():
                    self.finished.set_exception(exc)
                return
            self.results[i] = exc  # one item's failure is that item's result
        finally:
            self.free += 1
            self._settle(i)
            self.dispatch()

    def _unblock(self, i: int) -> None:
        self.blockers[i] -= 1
        if not self.blockers[i]:
            heapq.heappush(self.ready, self.position[i])

    def _prefilled(self, i: int) -> None:
        for follower in self.followers.pop(i, ()):
            self._unblock(follower)

    def _settle(self, i: int) -> None:
        self._prefilled(i)  # failed or cancelled: nobody waits for its prefill
        self.left -= 1
        after = self.next_turn.get(i)
        if after is not None:
            position = self.position[after]
            self.turn_pending.discard(position)
            if isinstance(self.results[i], BaseException):
                self.results[after] = TurnSkippedError(
                    f"not run: the turn before it (item {i}) failed: {self.results[i]}"
                )
                self.begun[position] = True
                self._settle(after)
            else:
                self.head = min(self.head, position)
                self._unblock(after)
        if not self.left and not self.finished.done():
            self.finished.set_result(None)


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
    deduped = await asyncio.to_thread(_plan_inputs, pipeline, window)
    key = pipeline.registry.key
    keys = [[key(chunk) for chunk in result.chunks] for result in deduped]
    heads = [(item.cache_salt or "", _system_key(item.system)) for item in window]
    # Only a turn that takes its history from the batch must wait for the turn before it.
    sessions = [item.session if item.history is None else None for item in window]
    tails = [_history_key(item.history) for item in window]
    # A chunk's length in bytes stands in for its tokens (none are counted yet).
    weights = {
        k: len(c.data)
        for r, ks in zip(deduped, keys, strict=True)
        for k, c in zip(ks, r.chunks, strict=True)
    }
    # Off the loop: with the look-ahead a large window plans for seconds.
    order, ranks = await asyncio.to_thread(plan_window, keys, heads, tails, weights)
    order = keep_turn_order(order, sessions)
    leaders = prefix_leaders(order, ranks, heads)
    del keys

    async def job(i: int, prefilled: Callable[[], None]) -> Any:
        item = window[i]
        history = item.history
        if history is None and item.session is not None:
            history = list(turns.get(item.session, ()))
        prepared = await asyncio.to_thread(
            pipeline.prepare, item.question, deduped[i], system=item.system, history=history,
            cache_salt=item.cache_salt, params=params, chunk_order=ranks[i], learn=False,
        )  # fmt: skip
        answer = None
        async for delta in pipeline.astream_prepared(prepared, params, cache_salt=item.cache_salt):
            prefilled()
            answer = delta.answer or answer
        if item.session is not None:
            assert answer is not None  # the stream's last delta carries the answer
            turns.setdefault(item.session, []).extend(
                [{"role": "user", "content": item.question},
                 {"role": "assistant", "content": answer.text}]
            )  # fmt: skip
        if bar is not None:
            bar.update(1)
        return answer

    jobs = [functools.partial(job, i) for i in range(len(window))]
    return await gather_in_order(jobs, order, sessions, limit, fail_fast=fail_fast, leaders=leaders)


def _plan_inputs(pipeline: Pipeline, window: Sequence[BatchItem]) -> list[DedupResult]:
    """Each item's chunks through the dedup stage (what the assembler will see; kept, so
    assembling the item later does not dedup again).

    Also teaches each namespace's system-prompt learner the window's system prompts in the
    caller's order: run in the batch's order, identical versions come together and the
    learner would take a changing part (a date) for a stable one.
    """
    systems: dict[str | None, list[Any]] = {}
    for item in window:
        systems.setdefault(item.cache_salt, []).append(item.system)
    for salt, versions in systems.items():
        pipeline.assembler_for(salt).learn_system(versions)
    return [pipeline.dedupe(item.chunks) for item in window]


def _history_key(history: Sequence[Turn] | None) -> tuple[str, ...]:
    if not history:
        return ()
    # Any shape: the assembler validates each item's history (and fails that item alone).
    return tuple(
        f"{turn.get('role', '')}:{turn.get('content', '')}"
        if isinstance(turn, Mapping)
        else repr(turn)
        for turn in history
    )


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

    def __post_init__(self) -> None:
        window = self.window
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise InvalidInputError(f"window must be an int >= 1, got {window!r}", param="window")
        _check_limit(self.max_in_flight)


def _window_jobs(pipeline: Pipeline, items: Iterable[Any], run: BatchRun) -> Iterator[Any]:
    """One coroutine per window (answers in the window's order), made when the previous
    window is done: the sync and async forms run them on their own loops or the caller's.
    A list of items is validated whole before the first window runs; an iterator, window
    by window (it is read lazily)."""
    if isinstance(items, Sequence) and not isinstance(items, str | bytes):
        items = [batch_item(item, i) for i, item in enumerate(items)]
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
