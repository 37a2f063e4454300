"""Opt-in containment dropping and overlap merging, still byte-exact."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from ragkv.dedup import Chunk, Deduplicator
from ragkv.dedup.containment import find_contained


def _doc(n: int, seed: int = 0) -> str:
    rnd = random.Random(seed)
    return "".join(rnd.choice("abcdefgh ") for _ in range(n))


def test_contained_chunk_is_dropped_only_when_asked():
    doc = _doc(400)
    chunks = [Chunk(doc[10:60], "s1", 0.9), Chunk(doc[:300], "s2", 0.1), doc[100:105]]
    assert len(Deduplicator().dedupe(chunks).chunks) == 3
    res = Deduplicator(drop_contained=True).dedupe(chunks)
    (survivor,) = res.chunks
    assert survivor.content == doc[:300]
    assert survivor.score == 0.9
    assert survivor.metadata["ragkv_sources"] == ("s2", "s1")
    assert survivor.metadata["ragkv_duplicates"] == 2
    assert res.survivor_of == [0, 0, 0]
    assert res.kept == [1]
    assert res.stats.contained_dropped == 2


def test_containment_is_byte_exact():
    doc = _doc(300)
    near_miss = doc[50:120].replace(doc[80], "Z" if doc[80] != "Z" else "Y", 1)
    res = Deduplicator(drop_contained=True).dedupe([doc, near_miss, doc[50:120]])
    assert [c.content for c in res.chunks] == [doc, near_miss]


_ab = st.text(alphabet="ab", min_size=1, max_size=80).map(str.encode)


@settings(max_examples=150, deadline=None)
@given(st.lists(_ab, min_size=1, max_size=12, unique=True))
def test_indexed_containment_matches_pairwise_scan(datas):
    """Small alphabet, lengths around the index threshold: compare with brute force."""
    found = find_contained(datas, [None] * len(datas))
    for i, d in enumerate(datas):
        inside = [j for j, o in enumerate(datas) if j != i and len(o) > len(d) and d in o]
        if i in found:
            host = found[i]
            assert datas[i] in datas[host] and host not in found
        else:  # containment is transitive, so a missed needle would be inside a kept host
            assert not inside


@settings(max_examples=150, deadline=None)
@given(st.lists(_ab, min_size=1, max_size=12))
def test_no_survivor_lies_inside_another(datas):
    res = Deduplicator(drop_contained=True).dedupe(datas)
    outs = [c.data for c in res.chunks]
    for i, a in enumerate(outs):
        assert not any(a in b for j, b in enumerate(outs) if j != i)
    for d, s in zip(datas, res.survivor_of, strict=True):
        assert d in res.chunks[s].data


def test_overlapping_windows_of_one_source_merge_into_one_span():
    doc = _doc(500, seed=3)
    w = [Chunk(doc[0:200], "doc"), Chunk(doc[300:500], "doc"), Chunk(doc[120:380], "doc")]
    res = Deduplicator(merge_overlaps=True, min_overlap=64).dedupe(w)
    (span,) = res.chunks
    assert span.content == doc
    assert res.stats.overlaps_merged == 2
    assert res.survivor_of == [0, 0, 0]
    assert span.metadata["ragkv_duplicates"] == 2


def test_overlap_merge_needs_opt_in_same_source_and_min_overlap():
    doc = _doc(400, seed=4)
    same = [Chunk(doc[:200], "d"), Chunk(doc[150:400], "d")]  # 50-byte overlap
    assert len(Deduplicator().dedupe(same).chunks) == 2
    assert len(Deduplicator(merge_overlaps=True, min_overlap=64).dedupe(same).chunks) == 2
    assert len(Deduplicator(merge_overlaps=True, min_overlap=32).dedupe(same).chunks) == 1
    other = [Chunk(doc[:200], "d1"), Chunk(doc[100:400], "d2")]
    assert len(Deduplicator(merge_overlaps=True).dedupe(other).chunks) == 2
    unsourced = [doc[:200], doc[100:400]]
    assert len(Deduplicator(merge_overlaps=True).dedupe(unsourced).chunks) == 2


def test_merged_span_keeps_multibyte_text_and_invalid_bytes_exact():
    rnd = random.Random(7)
    text = "".join(rnd.choice("žluťočký kůň€😀") for _ in range(300))
    res = Deduplicator(merge_overlaps=True, min_overlap=16).dedupe(
        [Chunk(text[:150], "t"), Chunk(text[100:], "t")]
    )
    assert [c.content for c in res.chunks] == [text]
    raw = random.Random(8).randbytes(256)
    res = Deduplicator(merge_overlaps=True, min_overlap=16).dedupe(
        [Chunk(raw[:200], "r"), Chunk(raw[150:], "r")]
    )
    assert [c.content for c in res.chunks] == [raw]


def test_merge_then_contain_catches_a_chunk_straddling_the_seam():
    doc = _doc(600, seed=5)
    chunks = [Chunk(doc[:300], "d"), Chunk(doc[200:600], "d"), Chunk(doc[250:350], "other")]
    res = Deduplicator(drop_contained=True, merge_overlaps=True).dedupe(chunks)
    assert [c.content for c in res.chunks] == [doc]
    assert res.stats.contained_dropped == 1 and res.stats.overlaps_merged == 1
