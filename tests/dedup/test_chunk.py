"""Chunk model: coercion, bytes vs text, cached identity."""

from ragkv.dedup import Chunk, content_hash


def test_coerce_accepts_str_bytes_and_chunks():
    c = Chunk("x", source_id="d")
    assert Chunk.coerce(c) is c
    assert Chunk.coerce("é").data == "é".encode()
    assert Chunk.coerce(bytearray(b"ab")).content == b"ab"


def test_text_is_for_display_and_data_is_identity():
    c = Chunk(b"ok \xff")
    assert c.text == "ok \ufffd"
    assert c.data == b"ok \xff"
    assert c.digest() == content_hash(b"ok \xff")


def test_caches_follow_a_reassigned_content():
    c = Chunk("first")
    old = c.digest()
    c.content = "second"
    assert c.data == b"second"
    assert c.digest() != old and c.digest() == content_hash(b"second")


def test_equality_ignores_caches():
    a, b = Chunk("same"), Chunk("same")
    a.digest()
    assert a == b
