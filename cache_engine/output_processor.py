"""What each caller receives: per-request text, stream deltas and the final ``Output``.

The scheduler appends tokens and ends a request on a stop token, ``max_tokens`` or the
context length; this module turns each new token into text (incremental detokenization),
ends a request on a stop string (which needs the text), and builds the ``Output`` with its
``Usage`` and ``Timings``. A request's state is made in its caller's thread (the stop
matcher is compiled there) and lives until its final event is delivered.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ragkv.cache_engine.detokenizer import IncrementalDetokenizer
from ragkv.cache_engine.outputs import Output, StreamDelta, Timings, Usage
from ragkv.cache_engine.request import Request
from ragkv.cache_engine.sampler import TokenLogprobs
from ragkv.cache_engine.step import SchedulerOutput

logger = logging.getLogger(__name__)

Sink = Callable[[StreamDelta | BaseException], None]


@dataclass(slots=True, eq=False)
class RequestState:
    """One request's output side: its detokenizer, where its events go, what it asked for."""

    request: Request
    detokenizer: IncrementalDetokenizer
    sink: Sink | None = None
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # rows kept for return_logits
    logits_start: int = 0  # position of the first kept row


class OutputProcessor:
    """Output state of every request taken in, keyed by request id."""

    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.states: dict[str, RequestState] = {}

    def new_state(self, request: Request) -> RequestState:
        """The request's output state (call in the caller's thread: it builds the matcher)."""
        detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            request.prompt_token_ids,
            request.params,
            eos_token_ids=self.eos_token_ids,
        )
        return RequestState(request, detokenizer)

    def add(self, state: RequestState) -> None:
        self.states[state.request.request_id] = state

    def get(self, request_id: str) -> Request | None:
        state = self.states.get(request_id)
        return None if state is None else state.request

    def requests(self) -> list[Request]:
        return [state.request for state in self.states.values()]

    def keep_logits(self, batch: SchedulerOutput, rows: list[torch.Tensor | None]) -> None:
        """Keep the step's ``return_logits`` rows; a preempted request's are recomputed."""
        for request in batch.preempted:
            state = self.states.get(request.request_id)
            if state is not None:
                state.logits.clear()
        for chunk, kept in zip(batch.slices, rows, strict=True):
            state = self.states.get(chunk.request.request_id)
            if kept is not None and state is not None:
                if not state.logits:
                    state.logits_start = chunk.start
                state.logits.append(kept)

    def on_token(
        self, request: Request, token: int, logprobs: TokenLogprobs | None
    ) -> tuple[str | None, str]:
        """Take the request's new token: ``(finish_reason, text)``, the reason None while it
        goes on (the scheduler's reasons, or a stop string found in the text)."""
        state = self.states[request.request_id]
        if request.params.logprobs is not None:
            state.logprobs.append(logprobs)
        detok = state.detokenizer
        # The scheduler decided stop tokens and length for this token; the detokenizer
        # only finds stop strings.
        delta = detok.add(token, request.finish_reason if request.finished else None)
        if detok.finished:
            return detok.finish_reason, delta
        return None, delta

    def flush(self, request: Request) -> str:
        """Text still held back, for a request ended for the engine's own reasons (abort)."""
        return self.states[request.request_id].detokenizer.flush()

    def final(self, request: Request, delta: str, tokens: list[int]) -> StreamDelta:
        """The request's last event, carrying its :class:`Output`."""
        state = self.states[request.request_id]
        request.finish_time = finish = time.perf_counter()
        arrival = request.arrival_time
        first_token = request.first_token_time or finish
        output = Output(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=request.output_token_ids,
            text=state.detokenizer.text,
            finish_reason=request.finish_reason or "abort",
            usage=Usage(
                prompt_tokens=request.num_prompt_tokens,
                completion_tokens=request.num_output_tokens,
                cached_tokens=request.num_cached_tokens or 0,
                cached_tokens_by_tier=request.cached_tokens_by_tier,
                reused_nonprefix_tokens=request.reused_nonprefix_tokens,
                reused_approximate_prefix_tokens=request.reused_approximate_prefix_tokens,
            ),
            timings=Timings(
                queue_s=(request.first_scheduled_time or finish) - arrival,
                ttft_s=first_token - arrival,
                total_s=finish - arrival,
            ),
            logprobs=state.logprobs if request.params.logprobs is not None else None,
            num_preemptions=request.num_preemptions,
            logits=torch.cat(state.logits) if state.logits else None,
            logits_start=state.logits_start,
            approximate=request.exact_until is not None,
        )
        return StreamDelta(request.request_id, delta, tokens, output.finish_reason, output)

    def deliver(
        self, request: Request, event: StreamDelta | BaseException, last: bool = False
    ) -> bool:
        """Hand an event to the request's caller, forgetting the request after its ``last``.

        False (and the request forgotten) when the caller is gone, e.g. its event loop
        closed: the engine then aborts the request instead of failing itself.
        """
        state = self.states.get(request.request_id)
        if state is None:
            return True
        if last:
            del self.states[request.request_id]
        assert state.sink is not None  # EngineCore.submit sets it before queueing the request
        try:
            state.sink(event)
        except Exception:
            logger.warning("dropping request %s: its caller is gone", request.request_id)
            self.states.pop(request.request_id, None)
            return False
        return True
