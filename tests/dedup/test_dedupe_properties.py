"""Properties every dedupe result must satisfy, for any input."""

from hypothesis import given, settings
from hypothesis import strategies as st

from ragkv.dedup import Chunk, Deduplicator

# Few distinct values so duplicates are common; bytes include invalid UTF-8.
_text = st.sampled_from(["", "a", "b", "ab", "é", "e\u0301", "a b", "a  b", "\udc80"])
_raw = st.sampled_from([b"", b"a", b"\xff\xfe", b"ab", b"\xc3\xa9"])
_chunk = st.builds(
    Chunk,
    st.one_of(_text, _raw),
    source_id=st.sampled_from([None, "d1", "d2"]),
    score=st.one_of(st.none(), st.floats(-1, 1)),
)
_inputs = st.lists(st.one_of(_text, _raw, _chunk), max_size=30)
_dedupers = st.sampled_from([Deduplicator(), Deduplicator(hash="xxh3_128")])


def _bytes(c: object) -> bytes:
    return Chunk.coerce(c).data


@settings(max_examples=150, deadline=None)
@given(_inputs, _dedupers)
def test_output_is_a_subsequence_of_unique_nonempty_inputs(chunks, dd):
    res = dd.dedupe(chunks)
    assert res.kept == sorted(res.kept)
    for out, pos in zip(res.chunks, res.kept, strict=True):
        assert out.data == _bytes(chunks[pos])
    datas = [c.data for c in res.chunks]
    assert len(set(datas)) == len(datas)
    assert all(datas)


@settings(max_examples=150, deadline=None)
@given(_inputs, _dedupers)
def test_every_input_maps_to_a_survivor_with_equal_bytes(chunks, dd):
    res = dd.dedupe(chunks)
    assert len(res.survivor_of) == len(chunks)
    for chunk, s in zip(chunks, res.survivor_of, strict=True):
        if s is None:
            assert _bytes(chunk) == b""
        else:
            assert res.chunks[s].data == _bytes(chunk)
    st_ = res.stats
    assert st_.chunks_in == len(chunks)
    assert st_.chunks_out + st_.duplicates_dropped + st_.empty_dropped == len(chunks)
    assert st_.bytes_in == sum(len(_bytes(c)) for c in chunks)
    assert st_.bytes_out == sum(len(c.data) for c in res.chunks)
    assert (
        sum(c.metadata["ragkv_duplicates"] + 1 for c in res.chunks)
        == st_.chunks_out + st_.duplicates_dropped
    )


@settings(max_examples=100, deadline=None)
@given(_inputs)
def test_dedupe_is_idempotent(chunks):
    dd = Deduplicator()
    once = dd.dedupe(chunks).chunks
    twice = dd.dedupe(once)
    assert twice.chunks == once
    assert twice.stats.duplicates_dropped == 0


@settings(max_examples=100, deadline=None)
@given(_inputs, st.randoms(use_true_random=False))
def test_set_of_survivor_bytes_does_not_depend_on_order(chunks, rnd):
    shuffled = list(chunks)
    rnd.shuffle(shuffled)
    dd = Deduplicator()
    a = {c.data for c in dd.dedupe(chunks).chunks}
    b = {c.data for c in dd.dedupe(shuffled).chunks}
    assert a == b


@settings(max_examples=100, deadline=None)
@given(st.lists(_text, max_size=30))
def test_fast_path_and_general_loop_agree(texts):
    """Plain str lists take the C-level path; adding one Chunk forces the general loop."""
    dd = Deduplicator()
    fast = dd.dedupe(texts)
    slow = dd.dedupe([*texts, Chunk("sentinel-only-here")])
    assert fast.survivor_of == slow.survivor_of[: len(texts)]
    assert [c.content for c in fast.chunks] == [c.content for c in slow.chunks[: len(fast.chunks)]]
    assert [c.metadata for c in fast.chunks] == [
        c.metadata for c in slow.chunks[: len(fast.chunks)]
    ]
