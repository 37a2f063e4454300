"""Opt-in position-independent chunk reuse: exact where it must be, approximate and labelled
where it may be, and never a source of approximate K/V for anyone else.

The strongest check uses a one-layer model: there, a token's K/V depends only on the token
and its position (layer 0 sees no context), so K/V copied from another prompt and
re-rotated to the new position must equal a fresh computation, and naive reuse (nothing
recomputed) must give the exact logits.
"""

from __future__ import annotations

import pytest
import torch
from support import ids, reference_logits, save_tiny_checkpoint

from ragkv.cache_engine import Engine, SamplingParams
from ragkv.cache_engine.chunk_reuse import BlendConfig
from ragkv.errors import ConfigError, InvalidInputError

ATOL = 1e-4
BLOCK = 16
SYSTEM, A, B = 20, 24, 24  # token counts: the first chunk starts after one full block


SYS, CHUNK_A, CHUNK_B = ids(1, SYSTEM), ids(2, A), ids(3, B)
SPANS = [(SYSTEM, SYSTEM + A), (SYSTEM + A, SYSTEM + A + B)]
FIRST = SYS + CHUNK_A + CHUNK_B + ids(4, 7)  # records A at 20 and B at 44
SECOND = SYS + CHUNK_B + CHUNK_A + ids(5, 7)  # B moves to 20, A to 44
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


def checkpoint(tmp_path_factory, layers: int):
    path = save_tiny_checkpoint(
        tmp_path_factory.mktemp(f"blend{layers}"), "llama", seed=5, num_hidden_layers=layers
    )
    from transformers import AutoModelForCausalLM

    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory):
    return checkpoint(tmp_path_factory, 1)


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory):
    return checkpoint(tmp_path_factory, 2)


def engine(path, **kwargs) -> Engine:
    kwargs.setdefault("kv_cache_tokens", 2048)
    return Engine.from_pretrained(path, device="cpu", block_size=BLOCK, **kwargs)


def computed_positions(out, reused: set[int]) -> list[int]:
    """Positions whose logits a blended request kept: computed prompt positions, then decode."""
    n = len(out.prompt_token_ids)
    prompt = [p for p in range(out.usage.cached_tokens, n) if p not in reused]
    return prompt + list(range(n, n + len(out.token_ids) - 1))


def assert_no_block_held(eng: Engine) -> None:
    """Every pin and block reference was released once all requests finished."""
    assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks


def test_one_layer_naive_reuse_is_exact_so_placement_equals_fresh_computation(one_layer):
    path, model = one_layer
    with engine(path) as eng:
        eng.generate(FIRST, GREEDY, chunk_spans=SPANS)  # exact; records both chunks
        out = eng.generate(
            SECOND, GREEDY, chunk_spans=SPANS, reuse=BlendConfig("none"), return_logits=True
        )
        assert_no_block_held(eng)
    assert out.usage.cached_tokens == BLOCK
    assert out.usage.reused_nonprefix_tokens == A + B
    assert out.approximate
    reused = set(range(SYSTEM, SYSTEM + A + B))
    expected = reference_logits(model, SECOND + out.token_ids[:-1])[computed_positions(out, reused)]
    assert out.logits.shape == expected.shape
    assert (out.logits - expected).abs().max().item() <= ATOL


def test_recomputing_every_reused_token_equals_the_exact_path(two_layers):
    path, model = two_layers
    with engine(path) as eng:
        eng.generate(FIRST, GREEDY, chunk_spans=SPANS)
        out = eng.generate(
            SECOND,
            GREEDY,
            chunk_spans=SPANS,
            reuse=BlendConfig("first-k", k=max(A, B)),
            return_logits=True,
        )
        assert eng.chunk_index.num_hits == 2  # both chunks were found, then recomputed
        assert_no_block_held(eng)
    assert out.usage.reused_nonprefix_tokens == 0 and not out.approximate
    expected = reference_logits(model, SECOND + out.token_ids[:-1])[BLOCK:]
    assert (out.logits - expected).abs().max().item() <= ATOL


def test_naive_reuse_reuses_computes_less_and_is_labelled_approximate(two_layers):
    path, _ = two_layers
    with engine(path) as eng:
        eng.generate(FIRST, GREEDY, chunk_spans=SPANS)
        before = eng.stats().prefill_tokens_computed
        out = eng.generate(SECOND, GREEDY, chunk_spans=SPANS, reuse=BlendConfig("none"))
        computed = eng.stats().prefill_tokens_computed - before
        first_k = eng.generate(
            SECOND[:-1] + [7], GREEDY, chunk_spans=SPANS, reuse=BlendConfig("first-k", k=4)
        )
        stats = eng.stats()
    assert out.approximate and out.usage.reused_nonprefix_tokens == A + B
    assert computed == len(SECOND) - BLOCK - (A + B)
    assert out.usage.to_openai()["reused_nonprefix_tokens"] == A + B
    assert first_k.usage.reused_nonprefix_tokens == A + B - 8
    assert stats.prefill_tokens_reused_nonprefix == 2 * (A + B) - 8


def test_reuse_off_records_but_never_reuses(two_layers):
    path, _ = two_layers
    with engine(path) as eng:
        eng.generate(FIRST, GREEDY, chunk_spans=SPANS)
        out = eng.generate(SECOND, GREEDY, chunk_spans=SPANS)
    assert len(eng.chunk_index) == 2
    assert out.usage.reused_nonprefix_tokens == 0 and not out.approximate


def test_salted_requests_never_share_chunk_index_entries(two_layers):
    path, _ = two_layers
    naive = BlendConfig("none")
    with engine(path) as eng:
        eng.generate(FIRST, GREEDY, chunk_spans=SPANS, cache_salt="alice")
        other = eng.generate(SECOND, GREEDY, chunk_spans=SPANS, cache_salt="bob", reuse=naive)
        unsalted = eng.generate(SECOND, GREEDY, chunk_spans=SPANS, reuse=naive)
        same = eng.generate(
            SECOND[:-1] + [9], GREEDY, chunk_spans=SPANS, cache_salt="alice", reuse=naive
        )
    assert other.usage.reused_nonprefix_tokens == 0
    assert unsalted.usage.reused_nonprefix_tokens == 0
    assert same.usage.reused_nonprefix_tokens == A + B


def test_approximate_blocks_are_never_hit_nor_recorded(two_layers):
    path, model = two_layers
    with engine(path) as eng:
        eng.generate(FIRST, GREEDY, chunk_spans=SPANS)
        eng.generate(SECOND, GREEDY, chunk_spans=SPANS, reuse=BlendConfig("none"))
        starts = sorted(loc.start for loc in _locations(eng))
        exact = eng.generate(SECOND, GREEDY, chunk_spans=SPANS, return_logits=True)
        assert_no_block_held(eng)
    assert starts == [SYSTEM, SYSTEM + A]  # still where FIRST computed them
    assert exact.usage.cached_tokens == BLOCK  # the exact prefix only
    assert not exact.approximate
    expected = reference_logits(model, SECOND + exact.token_ids[:-1])[BLOCK:]
    assert (exact.logits - expected).abs().max().item() <= ATOL


def test_what_precedes_the_first_copied_token_is_exact_and_cached(two_layers):
    path, model = two_layers
    new_chunk = ids(6, A)
    third = SYS + new_chunk + CHUNK_A + ids(7, 7)  # the new chunk is computed, then A copied
    with engine(path) as eng:
        eng.generate(FIRST, GREEDY, chunk_spans=SPANS)
        blended = eng.generate(third, GREEDY, chunk_spans=SPANS, reuse=BlendConfig("none"))
        starts = sorted(loc.start for loc in _locations(eng))
        later = SYS + new_chunk + ids(8, 30)
        exact = eng.generate(later, GREEDY, return_logits=True)
        assert_no_block_held(eng)
    assert blended.usage.reused_nonprefix_tokens == A
    assert starts == [SYSTEM, SYSTEM, SYSTEM + A]  # the new chunk, recorded at 20
    assert exact.usage.cached_tokens == 2 * BLOCK  # blocks wholly before the copied A
    expected = reference_logits(model, later + exact.token_ids[:-1])[2 * BLOCK :]
    assert (exact.logits - expected).abs().max().item() <= ATOL


def test_chunks_a_blended_request_computes_are_learned_for_its_reuse_settings_only(two_layers):
    path, _ = two_layers
    naive, first_k = BlendConfig("none"), BlendConfig("first-k", k=4)
    new_chunk = ids(6, A)
    blended = SYS + CHUNK_B + new_chunk + ids(7, 7)  # B copied to 20, the new chunk after it

    def moved(gap: int) -> tuple[list[int], list[tuple[int, int]]]:  # the new chunk alone
        return SYS + ids(8, gap) + new_chunk + ids(9, 7), [(SYSTEM + gap, SYSTEM + gap + A)]

    with engine(path) as eng:
        eng.generate(FIRST, GREEDY, chunk_spans=SPANS)
        eng.generate(blended, GREEDY, chunk_spans=SPANS, reuse=naive)
        starts = sorted(loc.start for loc in _locations(eng))
        approximate = eng.chunk_index.num_approximate
        prompt, spans = moved(12)
        same_scope = eng.generate(prompt, GREEDY, chunk_spans=spans, reuse=naive)
        prompt, spans = moved(3)  # another position, so no exact prefix covers the chunk
        other_scope = eng.generate(prompt, GREEDY, chunk_spans=spans, reuse=first_k)
        assert_no_block_held(eng)
    assert starts == [SYSTEM, SYSTEM + A, SYSTEM + B]  # A, B where FIRST left them; new at 44
    assert approximate == 1  # it attended to the copied B
    assert other_scope.usage.reused_nonprefix_tokens == 0
    assert same_scope.usage.reused_nonprefix_tokens == A and same_scope.approximate


def test_a_chunk_an_admitted_request_is_computing_is_waited_for_not_computed_twice(two_layers):
    path, _ = two_layers
    naive = BlendConfig("none")
    # B sits after 5 other tokens here: no prefix of FIRST covers it, only the index can.
    later = SYS + ids(8, 5) + CHUNK_B + ids(5, 7)
    spans = [(SYSTEM + 5, SYSTEM + 5 + B)]
    with engine(path) as eng:  # submitted together: admitted in the same step
        first, second = eng.generate(
            [FIRST, later], GREEDY, chunk_spans=[SPANS, spans], reuse=naive
        )
        assert_no_block_held(eng)
        assert eng.stats().blend_waits == 1
        source = eng.scheduler.sources[-1]
        assert not source._computing and not source._awaits and not source._waited
    assert first.usage.reused_nonprefix_tokens == 0
    assert second.usage.reused_nonprefix_tokens == B and second.approximate


def test_an_exact_request_never_waits_for_a_chunk_being_computed(two_layers):
    path, _ = two_layers
    later = SYS + ids(8, 5) + CHUNK_B + ids(5, 7)
    spans = [(SYSTEM + 5, SYSTEM + 5 + B)]
    with engine(path) as eng:  # FIRST's chunks are in flight when ``later`` is admitted
        first, second = eng.generate([FIRST, later], GREEDY, chunk_spans=[SPANS, spans])
        assert eng.stats().blend_waits == 0
    assert second.usage.reused_nonprefix_tokens == 0 and not second.approximate


def test_evicted_source_blocks_are_never_read(one_layer):
    path, model = one_layer
    with engine(path, kv_cache_tokens=8 * BLOCK) as eng:
        eng.generate(FIRST, GREEDY, chunk_spans=SPANS)
        eng.generate(ids(9, 7 * BLOCK), GREEDY)  # reuses every block of the pool
        out = eng.generate(
            SECOND, GREEDY, chunk_spans=SPANS, reuse=BlendConfig("none"), return_logits=True
        )
        assert eng.chunk_index.num_stale >= 1
        assert_no_block_held(eng)
    assert out.usage.reused_nonprefix_tokens == 0 and not out.approximate
    expected = reference_logits(model, SECOND + out.token_ids[:-1])[out.logits_start :]
    assert (out.logits - expected).abs().max().item() <= ATOL


def test_sources_that_leave_no_room_when_pinned_fall_back_to_the_exact_path(one_layer):
    path, _ = one_layer
    with engine(path, kv_cache_tokens=6 * BLOCK) as eng:
        eng.generate(FIRST, GREEDY, chunk_spans=SPANS)  # 5 blocks, all sources but one
        out = eng.generate(SECOND, GREEDY, chunk_spans=SPANS, reuse=BlendConfig("none"))
        assert eng.stats().blend_fallbacks == 1
        assert_no_block_held(eng)
    assert out.usage.reused_nonprefix_tokens == 0 and not out.approximate


def test_reuse_inputs_are_validated_in_the_callers_thread(two_layers):
    path, _ = two_layers
    with engine(path) as eng:
        bad = [
            ({"reuse": BlendConfig()}, "chunk_spans"),  # reuse without spans
            ({"chunk_spans": [(5, 3)]}, "chunk_spans"),
            ({"chunk_spans": [(0, 10), (5, 20)]}, "chunk_spans"),  # overlapping
            ({"chunk_spans": [(0, len(FIRST) + 1)]}, "chunk_spans"),
            ({"chunk_spans": "0:10"}, "chunk_spans"),
            ({"chunk_spans": [(0.0, 10)]}, "chunk_spans"),
            ({"chunk_spans": SPANS, "reuse": "blend"}, "reuse"),
        ]
        for kwargs, param in bad:
            with pytest.raises(InvalidInputError) as err:
                eng.generate(FIRST, GREEDY, **kwargs)
            assert err.value.param == param
        with pytest.raises(InvalidInputError):
            eng.generate([FIRST, SECOND], GREEDY, chunk_spans=[SPANS])  # one list per prompt
    with pytest.raises(ConfigError) as err:
        BlendConfig("attention")
    assert err.value.param == "strategy"
    with pytest.raises(ConfigError):
        BlendConfig("first-k", k=-1)


def _locations(eng: Engine):
    return [entry.location for entry in eng.chunk_index._entries.values()]


# -- approximate blocks kept for later opted-in requests (issue 25) ------------------------


def test_an_opted_in_follow_up_shares_the_approximate_blocks_a_blended_request_left(two_layers):
    path, model = two_layers
    naive = BlendConfig("none")
    with engine(path) as eng:
        eng.generate(FIRST, GREEDY, chunk_spans=SPANS)
        eng.generate(SECOND, GREEDY, chunk_spans=SPANS, reuse=naive)
        before = eng.stats().prefill_tokens_computed
        again = eng.generate(SECOND, GREEDY, chunk_spans=SPANS, reuse=naive)
        computed = eng.stats().prefill_tokens_computed - before
        exact = eng.generate(SECOND, GREEDY, chunk_spans=SPANS, return_logits=True)
        assert_no_block_held(eng)
    # SECOND is 75 tokens: block 0 exact, blocks 1-3 approximate (the copy starts at 20),
    # so the follow-up computes only its last partial block, less chunk A's last 4 tokens
    # (64-67: the shared blocks end inside A, whose tail is copied).
    assert again.usage.cached_tokens == BLOCK  # exact prefix only
    assert again.usage.reused_approximate_prefix_tokens == 3 * BLOCK
    assert again.approximate
    assert again.usage.to_openai()["reused_approximate_prefix_tokens"] == 3 * BLOCK
    assert computed == 75 - 4 * BLOCK - 4 and again.usage.reused_nonprefix_tokens == 4
    # An exact request of the same prompt never sees them.
    assert exact.usage.cached_tokens == BLOCK and not exact.approximate
    expected = reference_logits(model, SECOND + exact.token_ids[:-1])[BLOCK:]
    assert (exact.logits - expected).abs().max().item() <= ATOL


def test_approximate_blocks_are_not_shared_across_salts_or_reuse_settings(two_layers):
    path, _ = two_layers
    with engine(path) as eng:
        for salt in ("t1", "t2"):
            eng.generate(FIRST, GREEDY, chunk_spans=SPANS, cache_salt=salt)
        eng.generate(SECOND, GREEDY, chunk_spans=SPANS, reuse=BlendConfig("none"), cache_salt="t1")
        other_salt = eng.generate(
            SECOND, GREEDY, chunk_spans=SPANS, reuse=BlendConfig("none"), cache_salt="t2"
        )
        other_k = eng.generate(
            SECOND, GREEDY, chunk_spans=SPANS, reuse=BlendConfig("first-k", 4), cache_salt="t1"
        )
        same = eng.generate(
            SECOND, GREEDY, chunk_spans=SPANS, reuse=BlendConfig("none"), cache_salt="t1"
        )
        assert_no_block_held(eng)
    assert other_salt.usage.reused_approximate_prefix_tokens == 0
    assert other_k.usage.reused_approximate_prefix_tokens == 0
    assert same.usage.reused_approximate_prefix_tokens == 3 * BLOCK


def test_approximate_blocks_are_never_offered_to_the_kv_tiers(two_layers):
    path, _ = two_layers
    with engine(path) as eng:
        eng.generate(FIRST, GREEDY, chunk_spans=SPANS)
        eng.generate(SECOND, GREEDY, chunk_spans=SPANS, reuse=BlendConfig("none"))
        approx = [b for b in range(eng.kv.num_blocks) if eng.kv.pool.block_hash[b] is not None]
        registered = [b for b in approx if eng.kv.registered(b) is not None]
        assert len(approx) - len(registered) == 3  # SECOND's blocks 1-3


def test_kv_events_tell_only_exact_blocks_stored_and_removed(two_layers):
    from ragkv.cache_engine.kv_events import BlockRemoved, BlockStored

    path, _ = two_layers
    with engine(path, kv_cache_tokens=10 * BLOCK) as eng:
        events = eng.kv_events()
        eng.generate(FIRST, GREEDY, chunk_spans=SPANS)
        blended = eng.generate(SECOND, GREEDY, chunk_spans=SPANS, reuse=BlendConfig("none"))
        eng.generate(ids(9, 9 * BLOCK), GREEDY)  # evicts everything before it
        told, _ = events.take(timeout_s=1)
    stored = [h for e in told if isinstance(e, BlockStored) for h in e.block_hashes]
    removed = [h for e in told if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert blended.usage.reused_nonprefix_tokens == A + B  # it left 3 approximate blocks
    assert len(removed) >= 4  # FIRST's blocks, evicted with them
    assert set(removed) <= set(stored)  # but an approximate block is never told


def test_an_approximate_chunk_entry_yields_to_exact_and_to_its_own_scope_only():
    from ragkv.cache_engine.chunk_reuse.index import ChunkIndex

    index, gens, tokens = ChunkIndex(), [0] * 8, ids(6, 8)
    index.record(None, tokens, 0, [1], BLOCK, gens, b"scope-x")
    index.record(None, tokens, 0, [2], BLOCK, gens, b"scope-y")  # x's is no use to y
    assert index.lookup(None, tokens, gens, b"scope-x") is None
    assert index.lookup(None, tokens, gens, b"scope-y").block_ids == (2,)
    index.record(None, tokens, 0, [3], BLOCK, gens, b"scope-y")  # a live one of its scope
    assert index.lookup(None, tokens, gens, b"scope-y").block_ids == (2,)
    index.record(None, tokens, 0, [4], BLOCK, gens)  # exact replaces it
    index.record(None, tokens, 0, [5], BLOCK, gens, b"scope-x")  # and is never replaced
    assert index.lookup(None, tokens, gens, b"scope-x").block_ids == (4,)
    gens[4] += 1  # exact entry's block handed out again: an approximate one may take over
    index.record(None, tokens, 0, [5], BLOCK, gens, b"scope-x")
    assert index.lookup(None, tokens, gens, b"scope-x").block_ids == (5,)


def test_ratio_and_head_are_validated_and_part_of_the_reuse_scope():
    from ragkv.cache_engine.chunk_reuse.source import reuse_scope

    bad = [
        ({"ratio": -0.1}, "ratio"),
        ({"ratio": 1.5}, "ratio"),
        ({"ratio": float("nan")}, "ratio"),
        ({"ratio": True}, "ratio"),
        ({"ratio": "0.15"}, "ratio"),
        ({"strategy": "none", "ratio": 0.15}, "ratio"),
        ({"head": -1}, "head"),
        ({"head": 2.0}, "head"),
        ({"strategy": "first-k", "head": 4}, "head"),  # first-k's head is its k
    ]
    for kwargs, param in bad:
        kwargs.setdefault("strategy", "deviation")
        with pytest.raises(ConfigError) as err:
            BlendConfig(**kwargs)
        assert err.value.param == param, kwargs
    assert BlendConfig("deviation", ratio=1) == BlendConfig("deviation", ratio=1.0)
    scopes = {
        reuse_scope(c)
        for c in (
            BlendConfig("deviation", k=16, ratio=0),
            BlendConfig("deviation", k=16, ratio=0.15),
            BlendConfig("deviation", k=16, ratio=0.25),
            BlendConfig("deviation", k=16, ratio=0.15, head=4),
            BlendConfig("first-k", k=16, ratio=0.15),
        )
    }
    assert len(scopes) == 5


def test_the_default_is_deviation_at_a_ratio_and_explicit_settings_keep_their_scope():
    from ragkv.cache_engine.chunk_reuse.source import reuse_scope

    assert BlendConfig() == BlendConfig("deviation", k=16, ratio=0.15, head=0)
    assert BlendConfig("deviation") == BlendConfig("deviation", ratio=0.15)
    # an unset ratio is the strategy's: first-k and none mean what they meant before
    assert BlendConfig("first-k") == BlendConfig("first-k", k=16, ratio=0.0)
    assert BlendConfig("none").ratio == 0.0
    assert reuse_scope(BlendConfig("first-k", k=16)) == b"blend:first-k:16:ratio=0.0:head=0"
    assert reuse_scope(BlendConfig("none")) == b"blend:none:16:ratio=0.0:head=0"
    assert reuse_scope(BlendConfig()) == b"blend:deviation:16:ratio=0.15:head=0"


def test_approximate_blocks_of_one_ratio_are_not_shared_with_another(two_layers):
    path, _ = two_layers
    quarter = BlendConfig("first-k", k=0, ratio=0.25)
    with engine(path) as eng:
        eng.generate(FIRST, GREEDY, chunk_spans=SPANS)
        eng.generate(SECOND, GREEDY, chunk_spans=SPANS, reuse=quarter)
        other = eng.generate(
            SECOND, GREEDY, chunk_spans=SPANS, reuse=BlendConfig("first-k", k=0, ratio=0.5)
        )
        same = eng.generate(SECOND, GREEDY, chunk_spans=SPANS, reuse=quarter)
        assert_no_block_held(eng)
    # quarter copies from 26 (B's first 6 recomputed): blocks 1-3 approximate in its scope;
    # half copies from 32, so it cached block 1 exactly, and "same" shares only blocks 2-3
    assert other.usage.reused_approximate_prefix_tokens == 0
    assert same.usage.cached_tokens == 2 * BLOCK
    assert same.usage.reused_approximate_prefix_tokens == 2 * BLOCK
