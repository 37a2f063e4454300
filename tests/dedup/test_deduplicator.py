"""Deduplicator behaviour: metadata merging, keys, normalization, bad input, big chunks."""

import pytest

from ragkv.dedup import Chunk, Deduplicator
from ragkv.errors import ConfigError, InvalidChunkError, InvalidInputError, RagkvError


def test_first_occurrence_survives_and_metadata_merges():
    res = Deduplicator().dedupe(
        [
            Chunk("alpha", source_id="d1", score=0.2, metadata={"page": 1}),
            "beta",
            Chunk("alpha", source_id="d2", score=0.9, metadata={"page": 7}),
            b"alpha",
        ]
    )
    alpha, beta = res.chunks
    assert (alpha.content, alpha.source_id, alpha.score) == ("alpha", "d1", 0.9)
    assert alpha.metadata == {"page": 1, "ragkv_sources": ("d1", "d2"), "ragkv_duplicates": 2}
    assert beta.metadata == {"ragkv_sources": (), "ragkv_duplicates": 0}
    assert res.survivor_of == [0, 1, 0, 0]
    assert res.kept == [0, 1]
    assert res.duplicates == {2: 0, 3: 0}


def test_inputs_are_not_mutated():
    first = Chunk("x", metadata={"k": 1})
    Deduplicator().dedupe([first, Chunk("x", source_id="s")])
    assert first.metadata == {"k": 1}


def test_empty_chunks_are_dropped_and_counted():
    res = Deduplicator().dedupe(["", b"", Chunk(""), "x"])
    assert [c.content for c in res.chunks] == ["x"]
    assert res.survivor_of == [None, None, None, 0]
    assert res.stats.empty_dropped == 3


def test_invalid_utf8_is_kept_byte_exact():
    raw = b"\xff\xfe ok \xc3"
    res = Deduplicator().dedupe([raw, raw, b"\xff\xfe ok \xc4"])
    assert [c.data for c in res.chunks] == [raw, b"\xff\xfe ok \xc4"]
    assert res.chunks[0].content is raw
    assert "\ufffd" in res.chunks[0].text


def test_lone_surrogates_in_text_do_not_crash():
    res = Deduplicator().dedupe(["a\ud800", "a\ud800", "a"])
    assert [c.content for c in res.chunks] == ["a\ud800", "a"]


def test_ten_megabyte_chunk_works():
    big = "x" * (10 * 2**20)
    res = Deduplicator().dedupe([big, "y", big])
    assert res.stats.bytes_in == 2 * len(big) + 1
    assert res.survivor_of == [0, 1, 0]


@pytest.mark.parametrize("bad", [None, 3, 1.5, object(), ["nested"]])
def test_non_chunk_items_raise_invalid_chunk_error(bad):
    with pytest.raises(InvalidChunkError, match="str, bytes or ragkv.dedup.Chunk"):
        Deduplicator().dedupe(["ok", bad])


@pytest.mark.parametrize("bad", [None, "a string", b"bytes", 42, Chunk("one")])
def test_non_iterable_or_single_chunk_argument_is_rejected(bad):
    with pytest.raises(InvalidInputError):
        Deduplicator().dedupe(bad)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"metadata": ["not", "a", "dict"]},
        {"metadata": {1: "int key"}},
        {"source_id": 7},
        {"score": "high"},
        {"score": float("nan")},
    ],
)
def test_bad_chunk_fields_raise_invalid_input_error(kwargs):
    with pytest.raises(InvalidInputError):
        Chunk("text", **kwargs)


def test_malformed_ragkv_metadata_raises_instead_of_merging_garbage():
    with pytest.raises(InvalidInputError, match="ragkv_duplicates"):
        Deduplicator().dedupe([Chunk("a", metadata={"ragkv_duplicates": "many"}), "a"])


@pytest.mark.parametrize(
    "kwargs",
    [{"hash": "md5"}, {"normalize": "lower"}, {"min_overlap": 0}, {"key": 42}, {"key": []}],
)
def test_bad_configuration_raises_config_error(kwargs):
    with pytest.raises(ConfigError):
        Deduplicator(**kwargs)


def test_errors_share_the_ragkv_base_class():
    with pytest.raises(RagkvError):
        Chunk.coerce(None)


def test_normalization_is_off_by_default():
    texts = ["caf\u00e9", "cafe\u0301", "a  b", " a b"]
    assert len(Deduplicator().dedupe(texts).chunks) == 4


def test_nfc_normalization_collapses_composed_forms_but_keeps_original_bytes():
    res = Deduplicator(normalize="nfc").dedupe(["cafe\u0301", "caf\u00e9"])
    assert [c.content for c in res.chunks] == ["cafe\u0301"]


def test_whitespace_normalization_collapses_runs_and_keeps_invalid_bytes_apart():
    res = Deduplicator(normalize="whitespace").dedupe(
        ["a  b\n", " a b", b"\xff a", b"\xfe a", b"\xff  a"]
    )
    assert [c.data for c in res.chunks] == [b"a  b\n", b"\xff a", b"\xfe a"]


def test_key_fields_keep_same_text_from_different_documents_apart():
    chunks = [
        Chunk("same", source_id="d1"),
        Chunk("same", source_id="d2"),
        Chunk("same", source_id="d1"),
    ]
    assert len(Deduplicator().dedupe(chunks).chunks) == 1
    res = Deduplicator(key="source_id").dedupe(chunks)
    assert [c.source_id for c in res.chunks] == ["d1", "d2"]
    assert res.survivor_of == [0, 1, 0]


def test_callable_key_never_merges_different_bytes():
    res = Deduplicator(key=lambda c: 0).dedupe(["a", "b", "a"])
    assert [c.content for c in res.chunks] == ["a", "b"]


def test_unhashable_key_value_is_reported():
    chunks = [Chunk("a", metadata={"tags": ["x"]})]
    with pytest.raises(InvalidInputError, match="not hashable"):
        Deduplicator(key=("tags",)).dedupe(chunks)


def test_survivors_carry_their_content_hash():
    dd = Deduplicator(hash="xxh3_128")
    chunk = dd.dedupe(["hello", "hello"]).chunks[0]
    assert chunk._digest_algo == "xxh3_128"
    fresh = Chunk("hello")
    assert chunk.digest("xxh3_128") == fresh.digest("xxh3_128")
    assert chunk.digest("blake3") == fresh.digest("blake3")
