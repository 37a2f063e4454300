"""Residency probes run outside the assembler's lock (issue 28).

A probe asks the engine, which takes the engine core's lock: a busy engine (a long step, a
slow tier) must hold up only the request being probed, never every other request's
assembly on the same assembler. Before, the candidates were probed under the lock.
"""

from __future__ import annotations

import threading

from ragkv.assembler import Assembler

BS = 4
PASSAGES = [f"Passage {i}: " + " ".join(f"word{i * 5 + j}" for j in range(10)) for i in range(4)]
SYSTEM = "You are a careful assistant. Answer from the context."


def _assembler(tokenizer) -> Assembler:
    return Assembler(tokenizer, block_size=BS, never_worse_slack=0)


def test_the_engine_is_probed_without_the_assemblers_lock(local_tokenizer):
    asm = _assembler(local_tokenizer)
    held: list[bool] = []

    def residency(ids) -> int:
        held.append(asm._lock.locked())
        return 0

    asm.assemble(system=SYSTEM, chunks=PASSAGES[:3], question="Warm?")  # learn an order
    plan = asm.assemble(
        system=SYSTEM, chunks=PASSAGES[:3][::-1], question="Now?", residency=residency
    )
    assert held == [False, False]  # the canonical and the as-given candidates, both unlocked
    assert plan.stats.expected_as_given == plan.stats.expected_canonical == 0


def test_another_request_assembles_while_a_probe_waits_for_the_engine(local_tokenizer):
    asm = _assembler(local_tokenizer)
    probing, release = threading.Event(), threading.Event()
    results: dict[str, object] = {}

    def slow_engine(ids) -> int:  # an engine whose lock is held by a long step
        probing.set()
        release.wait(30)
        return 0

    def probed() -> None:
        results["probed"] = asm.assemble(
            system=SYSTEM, chunks=PASSAGES[:2], question="Slow?", residency=slow_engine
        )

    def other() -> None:
        results["other"] = asm.assemble(system=SYSTEM, chunks=PASSAGES[1:4], question="Fast?")

    first = threading.Thread(target=probed)
    first.start()
    try:
        assert probing.wait(30)
        second = threading.Thread(target=other)
        second.start()
        second.join(10)
        assert not second.is_alive(), "the other request waited for the probe's engine"
    finally:
        release.set()
        first.join(30)
    assert "other" in results and "probed" in results


def test_with_engine_residency_the_sent_prompt_is_not_hashed_again(local_tokenizer):
    # The assembler's own record of sent prompts stands in for an engine that cannot tell
    # what it holds; with the engine's probe it went unread but hashed every prompt again,
    # under the assembler's lock.
    asm = _assembler(local_tokenizer)
    asm.assemble(system=SYSTEM, chunks=PASSAGES[:3], question="Q?", residency=lambda ids: 0)
    assert len(asm.sent) == 0
    asm.assemble(system=SYSTEM, chunks=PASSAGES[:3], question="Q?")
    assert len(asm.sent) > 0
