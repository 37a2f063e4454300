"""A residency probe's hashes become the request's only when they are exactly the engine's own
(issue 28): same engine (block size, extra keys, algorithm), same salt, exactly the prompt's
token ids, and one request only. Anything else is hashed again, never trusted."""

from __future__ import annotations

import pytest
from support import ids

from ragkv.cache_engine import Engine, SamplingParams, block_hash
from ragkv.errors import InvalidInputError

BLOCK = 16
PARAMS = SamplingParams(max_tokens=2, ignore_eos=True)


@pytest.fixture
def hashed(monkeypatch):
    """Counts blocks hashed."""
    count = [0]
    real = block_hash._chained_digests

    def counting(parent, blocks, one):
        count[0] += len(blocks)
        return real(parent, blocks, one)

    monkeypatch.setattr(block_hash, "_chained_digests", counting)
    return count


def test_matching_hashes_are_the_requests_and_change_nothing(engine, hashed):
    tokens = ids(20, 70)  # 4 full blocks
    plain = engine.generate(tokens, PARAMS, cache_salt="t")
    cached, hashes = engine.prefix_probe("t")(tokens)
    assert cached == 64 and hashed[0] == 2 * 4  # the plain request's, the probe's
    out = engine.generate(tokens, PARAMS, cache_salt="t", prompt_hashes=hashes)
    assert hashed[0] == 2 * 4  # the prompt was not hashed again (72 tokens: no new block)
    assert out.token_ids == plain.token_ids
    assert out.usage.cached_tokens == cached


@pytest.mark.parametrize("mismatch", ["salt", "no salt", "tokens", "edited", "second use"])
def test_mismatched_hashes_are_hashed_again(engine, hashed, mismatch):
    tokens = ids(21, 70)
    probe_salt, salt = {"salt": ("a", "b"), "no salt": (None, "b")}.get(mismatch, ("a", "a"))
    engine.generate(tokens, PARAMS, cache_salt=probe_salt)
    sent = list(tokens)
    _, hashes = engine.prefix_probe(probe_salt)(sent)
    if mismatch == "tokens":
        sent = ids(22, 70)
    if mismatch == "edited":  # the caller changed the plan's list after the probe
        sent[5] = 3 if sent[5] != 3 else 4
    if mismatch == "second use":
        engine.generate(sent, PARAMS, cache_salt=salt, prompt_hashes=hashes)
    truth = engine.cached_prefix_length(sent, cache_salt=salt)  # what a plain request reuses
    hashed[0] = 0
    out = engine.generate(sent, PARAMS, cache_salt=salt, prompt_hashes=hashes)
    assert hashed[0] == 4  # hashed by the request itself
    assert out.usage.cached_tokens == truth
    assert truth == (64 if mismatch == "second use" else 0)  # never another salt's blocks


def test_another_engines_hashes_are_not_trusted(llama_dir, engine, hashed):
    tokens = ids(23, 40)
    with Engine.from_pretrained(llama_dir, device="cpu", kv_cache_tokens=2048) as other:
        _, hashes = other.prefix_probe()(tokens)
    hashed[0] = 0
    engine.generate(tokens, PARAMS, prompt_hashes=hashes)
    assert hashed[0] == 2  # 42 tokens: the prompt's two blocks, hashed here


def test_prompt_hashes_are_checked_before_anything_is_queued(engine):
    tokens = ids(24, 20)
    with pytest.raises(InvalidInputError) as info:
        engine.generate(tokens, PARAMS, prompt_hashes=[b"forged"])
    assert info.value.param == "prompt_hashes"
    _, hashes = engine.prefix_probe()(tokens)
    with pytest.raises(InvalidInputError) as info:
        engine.generate([tokens, tokens], PARAMS, prompt_hashes=[hashes])
    assert info.value.param == "prompt_hashes"
    outs = engine.generate([tokens, ids(25, 20)], PARAMS, prompt_hashes=[hashes, None])
    assert [len(o.token_ids) for o in outs] == [2, 2]
