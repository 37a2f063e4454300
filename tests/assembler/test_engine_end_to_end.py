"""End to end with the real engine: stable-first prompts hit the prefix cache."""

from __future__ import annotations

import pytest

from ragkv.assembler import Assembler, SegmentKind

pytestmark = pytest.mark.slow

HOT = [
    "The with statement wraps a block with methods defined by a context manager.",
    "A generator function returns an iterator; each yield suspends its frame.",
    "Dictionaries map hashable keys to arbitrary values and keep insertion order.",
]


@pytest.fixture(scope="module")
def engine():
    from ragkv.cache_engine import Engine
    from ragkv.errors import ModelNotFoundError

    try:
        eng = Engine.from_pretrained(device="cpu", kv_cache_tokens=2048)
    except ModelNotFoundError as exc:
        pytest.skip(f"embedded default model not installed: {exc}")
    with eng:
        yield eng


def test_reordered_hot_chunks_are_served_from_the_engine_cache(engine):
    from ragkv.cache_engine import SamplingParams

    asm = Assembler(engine.tokenizer, block_size=engine.block_size)
    system = "You answer questions about Python using only the context."
    for i in range(2):  # make the hot chunks stable
        asm.assemble(system=system, chunks=HOT if i else HOT[::-1], question="warm")
    first = asm.assemble(system=system, chunks=HOT, question="What is a generator?")
    engine.generate(first.token_ids, SamplingParams(max_tokens=1))
    second = asm.assemble(
        system=system,
        chunks=[HOT[2], HOT[0], HOT[1]],
        question="How do dictionaries order keys?",
        residency=engine.cached_prefix_length,
    )
    out = engine.generate(second.token_ids, SamplingParams(max_tokens=1))
    hot_end = second.spans(SegmentKind.CHUNK)[-1].end
    assert second.expected_cached_tokens >= hot_end - hot_end % engine.block_size
    assert out.usage.cached_tokens == second.expected_cached_tokens


def test_the_embedded_model_is_served_under_a_readable_name(engine):
    # The converted copy's directory carries a fingerprint; clients see the model's name.
    assert engine.model_name == "SmolLM2-135M-Instruct"
