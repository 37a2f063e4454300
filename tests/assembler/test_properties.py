"""Property tests: every kept chunk appears exactly once and decodes back to its text."""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ragkv.assembler import ORDERS, Assembler, SegmentKind
from ragkv.dedup import Chunk

# No specials: a chunk containing "<|im_end|>" is encoded as that special token (documented).
_text = st.text(st.characters(exclude_characters="<|>"), max_size=60)
_chunk = st.one_of(
    _text, _text.map(lambda t: t.encode("utf-8", "surrogatepass")), st.binary(max_size=30)
)
_settings = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@_settings
@given(
    requests=st.lists(st.lists(_chunk, max_size=6), min_size=1, max_size=3),
    order=st.sampled_from(ORDERS),
    slack=st.one_of(st.none(), st.integers(0, 60)),
)
@example(requests=[["lone \udb6d surrogate", b"\xff\xfe bad utf-8"]], order="retrieval", slack=None)
# One identity (the bytes) must be one text: a lone surrogate and its surrogatepass bytes.
@example(requests=[["\ud800"], [b"\xed\xa0\x80"]], order="retrieval", slack=None)
def test_every_kept_chunk_appears_once_and_decodes_to_its_text(
    any_tokenizer, requests, order, slack
):
    asm = Assembler(any_tokenizer, order=order)
    lossy = _lossy_bytes(any_tokenizer)
    for raw_chunks in requests:
        chunks = [Chunk.coerce(c) for c in raw_chunks]
        budget = None
        if slack is not None:
            budget = len(asm.assemble(system="S.", question="Q?")) + slack
        plan = asm.assemble(system="S.", chunks=chunks, question="Q?", max_prompt_tokens=budget)
        unique = {asm.registry.key(c): c for c in reversed(chunks)}
        spans = plan.spans(SegmentKind.CHUNK)
        kept = [s.content_hash for s in spans]
        assert len(kept) == len(set(kept))
        dropped = [asm.registry.key(d.chunk) for d in plan.dropped]
        assert sorted(kept + dropped) == sorted(unique)
        for span in spans:
            decoded = asm.decode(plan.token_ids[span.start : span.end])
            text = unique[span.content_hash].text
            assert decoded == asm.decode(asm.tokenizer.encode(text))
            if _round_trips(text, lossy):
                assert decoded == text
        if all(_round_trips(c.text, lossy) for c in chunks):
            assert asm.decode(plan.token_ids) == plan.text
        assert budget is None or len(plan) <= budget


def _round_trips(text: str, lossy: set[int]) -> bool:
    """Lone surrogates are tokenized as U+FFFD; lossy bytes are the tokenizer's own gaps."""
    data = text.encode("utf-8", "surrogatepass")
    return not lossy.intersection(data) and data == text.encode("utf-8", "replace")


def _lossy_bytes(tokenizer) -> set[int]:
    """Bytes whose byte-level symbol is missing from the vocab (the documented normalization).

    SmolLM2's vocab lacks 21 of the 256 (six control characters and most UTF-8 lead bytes
    F1-FF): such bytes are dropped or decode as U+FFFD. A full byte-level BPE lacks none.
    """
    vocab = tokenizer.get_vocab()
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    symbols, extra = {}, 0
    for byte in range(256):  # GPT-2's bytes_to_unicode mapping
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return {byte for byte, symbol in symbols.items() if symbol not in vocab}
