"""Which reused tokens are recomputed: deviation (CacheBlend's choice) against first-k, and
a chunk the exact prefix hit ends inside.

Two exact checks on tiny models: with two layers, the deviation probe refreshes layers 0
and 1 of every token, which is every layer, so a deviation blend must equal the exact
path whatever it chose; with one layer, K/V do not depend on context, so reusing the tail
of a chunk that straddles the prefix hit must equal the exact path too.
"""

from __future__ import annotations

import pytest
import torch
from support import ids, reference_logits, save_tiny_checkpoint

from ragkv.cache_engine import Engine, SamplingParams
from ragkv.cache_engine.chunk_reuse import BlendConfig, ChunkLocation, plan_blend

ATOL = 1e-4
BLOCK = 16
SYSTEM, A, B = 20, 24, 24
SYS, CHUNK_A, CHUNK_B = ids(1, SYSTEM), ids(2, A), ids(3, B)
SPANS = [(SYSTEM, SYSTEM + A), (SYSTEM + A, SYSTEM + A + B)]
FIRST = SYS + CHUNK_A + CHUNK_B + ids(4, 7)
SECOND = SYS + CHUNK_B + CHUNK_A + ids(5, 7)
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda n: f"{n}layers")
def model(request, tmp_path_factory):
    layers = request.param
    path = save_tiny_checkpoint(
        tmp_path_factory.mktemp(f"sel{layers}"), "llama", seed=5, num_hidden_layers=layers
    )
    from transformers import AutoModelForCausalLM

    return layers, path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def engine(path) -> Engine:
    return Engine.from_pretrained(path, device="cpu", block_size=BLOCK, kv_cache_tokens=2048)


def blend(path, prompt, spans, config, warm=FIRST):
    """Warm the chunk index with ``warm`` (exact), then run ``prompt`` blended."""
    with engine(path) as eng:
        eng.generate(warm, GREEDY, chunk_spans=SPANS)
        out = eng.generate(prompt, GREEDY, chunk_spans=spans, reuse=config, return_logits=True)
        assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks  # pins released
    return out


def test_deviation_recomputes_as_many_tokens_as_first_k(model):
    layers, path, _ = model
    first_k = blend(path, SECOND, SPANS, BlendConfig("first-k", k=4))
    deviation = blend(path, SECOND, SPANS, BlendConfig("deviation", k=4))
    assert deviation.usage.reused_nonprefix_tokens == first_k.usage.reused_nonprefix_tokens
    assert deviation.usage.reused_nonprefix_tokens == A + B - 8
    assert deviation.approximate and len(deviation.logits) == len(first_k.logits)


def test_two_layer_deviation_blend_is_exact_because_the_probe_refreshed_every_layer(model):
    layers, path, hf = model
    if layers != 2:
        pytest.skip("exact only when the probe's layers 0..1 are all the model's layers")
    out = blend(path, SECOND, SPANS, BlendConfig("deviation", k=4))
    expected = reference_logits(hf, SECOND + out.token_ids[:-1])
    # rows: the computed prompt positions (unknown here: chosen by deviation), then decode
    n = len(SECOND)
    assert (out.logits[-1 - (len(out.token_ids) - 1) :] - expected[n - 1 :]).abs().max() <= ATOL


def test_a_chunk_the_prefix_hit_ends_inside_is_reused_from_the_hit_on(model):
    layers, path, hf = model
    chunk_c = ids(6, 24)
    # the hit covers SYS and A's first 12 tokens (two blocks shared with FIRST)
    third = SYS + CHUNK_A + chunk_c + CHUNK_B + ids(7, 5)
    spans = [(20, 44), (44, 68), (68, 92)]
    out = blend(path, third, spans, BlendConfig("none"))
    assert out.usage.cached_tokens == 32
    assert out.usage.reused_nonprefix_tokens == (44 - 32) + B  # A's tail, and all of B
    if layers == 1:  # K/V without context: copies equal fresh computation
        reused = set(range(32, 44)) | set(range(68, 92))
        rows = [p for p in range(32, len(third)) if p not in reused]
        rows += range(len(third), len(third) + len(out.token_ids) - 1)
        expected = reference_logits(hf, third + out.token_ids[:-1])[rows]
        assert (out.logits - expected).abs().max().item() <= ATOL


def test_deviation_plan_holds_first_k_stand_ins_until_the_runner_chooses():
    location = ChunkLocation(start=100, num_tokens=8, block_ids=(6, 7), generations=(0, 0))
    tokens = list(range(30))

    def plan(config):
        return plan_blend(tokens, [(10, 18), (18, 26)], 8, config, lambda _: location, 16)

    first_k = plan(BlendConfig("first-k", k=2))
    deviation = plan(BlendConfig("deviation", k=2))
    assert deviation.positions == first_k.positions  # same count, stand-ins in place
    assert deviation.choose == 4 and deviation.reused_tokens == first_k.reused_tokens == 12
    assert deviation.dst_positions == list(range(10, 26))
    assert deviation.exact_until == 10 and deviation.start == 8
    deviation.choose_recomputed([15, 16, 20, 25])
    assert deviation.positions == [8, 9, 15, 16, 20, 25, 26, 27, 28, 29]
    assert 15 not in deviation.dst_positions and len(deviation.dst_positions) == 12
    assert len(deviation.src_slots) == len(deviation.deltas) == 12
    assert deviation.choose == 0 and deviation.reused_tokens == 12
    with pytest.raises(ValueError):
        plan(BlendConfig("deviation", k=2)).choose_recomputed([8, 9, 10, 11])  # not copied


def test_deviation_chooses_the_copied_tokens_whose_values_moved_most():
    from ragkv.cache_engine.chunk_reuse.deviation import choose_by_deviation
    from ragkv.cache_engine.chunk_reuse.planner import BlendPlan

    block_size, table = 4, [3, 1, 2]  # positions 0-3 in block 3, 4-7 in 1, 8-11 in 2
    copied = list(range(4, 11))
    plan = BlendPlan(
        positions=[4, 5, 11],  # 4 and 5: first-k stand-ins, among the copied positions
        dst_positions=copied,
        src_slots=list(range(100, 107)),
        deltas=[0] * len(copied),
        choose=2,
    )
    caches = [(torch.zeros(4, block_size, 1, 2), torch.zeros(4, block_size, 1, 2)) for _ in "ab"]
    moved = {9: 5.0, 6: 3.0, 10: 1.0}  # positions whose fresh values differ, by how much

    def probe(layer: int) -> None:
        values = caches[layer][1]
        for position, by in moved.items():
            values[table[position // block_size], position % block_size] += by

    choose_by_deviation(plan, table, caches, block_size, probe)
    assert plan.positions == [6, 9, 11] and plan.choose == 0
    assert plan.dst_positions == [4, 5, 7, 8, 10]
    assert plan.src_slots == [100, 101, 103, 104, 106]


def small_step_blend(path, config):
    """``SECOND`` blended after ``FIRST`` in an engine whose step runs 32 tokens: 19
    computed tokens fit it, a deviation probe over the 59 tokens from the plan's start does
    not."""
    with Engine.from_pretrained(
        path, device="cpu", block_size=BLOCK, kv_cache_tokens=2048, max_num_batched_tokens=32
    ) as eng:
        eng.generate(FIRST, GREEDY, chunk_spans=SPANS)
        out = eng.generate(SECOND, GREEDY, chunk_spans=SPANS, reuse=config, return_logits=True)
        return out, eng.stats()


def test_a_deviation_probe_larger_than_a_step_runs_first_k_of_the_same_budget(model):
    layers, path, _ = model
    first_k, first_k_stats = small_step_blend(path, BlendConfig("first-k", k=4))
    deviation, stats = small_step_blend(path, BlendConfig("deviation", k=4, ratio=0.15))
    assert deviation.approximate and deviation.usage.reused_nonprefix_tokens == A + B - 8
    assert stats.blend_probe_fallbacks == 1 and stats.blend_fallbacks == 0
    assert first_k_stats.blend_probe_fallbacks == 0
    # the first-k positions: the same rows computed, to the same values, the same tokens
    assert deviation.token_ids == first_k.token_ids
    assert deviation.logits_start == first_k.logits_start
    assert torch.equal(deviation.logits, first_k.logits)


def test_a_plan_too_big_for_a_step_even_as_first_k_falls_back_to_the_exact_path(model):
    layers, path, _ = model
    out, stats = small_step_blend(path, BlendConfig("deviation", k=16))
    assert not out.approximate and out.usage.reused_nonprefix_tokens == 0
    assert stats.blend_fallbacks == 1 and stats.blend_probe_fallbacks == 0


def two_chunk_plan(config: BlendConfig):
    """The plan of a 30-token prompt whose chunks (10, 18) and (18, 26) are both found."""
    location = ChunkLocation(start=100, num_tokens=8, block_ids=(6, 7), generations=(0, 0))
    return plan_blend(list(range(30)), [(10, 18), (18, 26)], 8, config, lambda _: location, 16)


def test_a_fallen_back_deviation_plan_is_the_first_k_plan_of_its_budget():
    first_k = two_chunk_plan(BlendConfig("first-k", k=2, ratio=0.3))
    for head in (0, 1):
        deviation = two_chunk_plan(BlendConfig("deviation", k=2, ratio=0.3, head=head))
        deviation.keep_first_k()
        assert deviation.choose == 0 and deviation.positions == first_k.positions
        assert deviation.dst_positions == first_k.dst_positions
        assert deviation.src_slots == first_k.src_slots and deviation.deltas == first_k.deltas
        assert deviation.reused_tokens == first_k.reused_tokens == 10


# -- a budget relative to the chunk (ratio) and a fixed head (issue 25) --------------------


def test_a_ratio_budget_scales_with_each_chunk_and_k_is_its_floor():
    # exact arithmetic: 0.15 * 600 is 90 (as a float product it rounds up to 91)
    assert BlendConfig("deviation", k=0, ratio=0.15).recomputed(600) == 90
    assert BlendConfig("deviation", k=0, ratio=0.15).recomputed(601) == 91
    assert BlendConfig("deviation", ratio=0.15).recomputed(50) == 16  # k=16 is the floor
    assert BlendConfig("first-k", k=0, ratio=0.25).recomputed(3) == 1
    assert BlendConfig("first-k", k=8, ratio=1).recomputed(5) == 5  # never past the chunk
    assert BlendConfig("deviation", k=4, ratio=0).recomputed(600) == 4  # ratio 0: k alone
    assert BlendConfig("deviation", k=4).recomputed(600) == 90  # unset: deviation's 0.15
    assert BlendConfig("first-k", k=4).recomputed(600) == 4  # unset: first-k's 0, as before
    assert BlendConfig("none", k=16).recomputed(600) == 0


def test_a_ratio_plan_recomputes_a_share_of_each_chunk_whatever_its_length():
    location = ChunkLocation(start=100, num_tokens=40, block_ids=(6, 7, 8), generations=(0,) * 3)
    tokens = list(range(80))
    spans = [(10, 18), (18, 58)]  # 8 and 40 tokens

    def plan(config):
        return plan_blend(tokens, spans, 8, config, lambda _: location, 16)

    first_k = plan(BlendConfig("first-k", k=0, ratio=0.25))  # 2 and 10 recomputed
    recomputed = [*range(10, 12), *range(18, 28)]
    assert first_k.positions[:2] == [8, 9] and first_k.positions[2:14] == recomputed
    assert first_k.reused_tokens == 8 + 40 - 12
    deviation = plan(BlendConfig("deviation", k=0, ratio=0.25))
    assert deviation.choose == 12 and deviation.reused_tokens == first_k.reused_tokens
    assert deviation.dst_positions == list(range(10, 58))  # every found token copied first


def test_a_deviation_head_is_computed_and_only_the_rest_of_the_budget_is_chosen():
    hybrid = two_chunk_plan(BlendConfig("deviation", k=3, head=1))
    assert hybrid.dst_positions == [*range(11, 18), *range(19, 26)]  # the heads never copied
    assert hybrid.choose == 4 and hybrid.reused_tokens == 16 - 6
    assert hybrid.exact_until == 11 and hybrid.start == 8
    hybrid.choose_recomputed([15, 16, 24, 25])
    assert hybrid.positions == [8, 9, 10, 15, 16, 18, 24, 25, 26, 27, 28, 29]
    capped = two_chunk_plan(BlendConfig("deviation", k=2, head=5))  # past the budget: first-k
    first_k = two_chunk_plan(BlendConfig("first-k", k=2))
    assert capped.choose == 0 and capped.positions == first_k.positions


def test_ratio_and_head_blends_run_and_recompute_their_budget(model):
    layers, path, hf = model
    ratio = blend(path, SECOND, SPANS, BlendConfig("deviation", k=0, ratio=0.25))  # 6 a chunk
    hybrid = blend(path, SECOND, SPANS, BlendConfig("deviation", k=0, ratio=0.25, head=2))
    for out in (ratio, hybrid):
        assert out.approximate and out.usage.reused_nonprefix_tokens == A + B - 12
    if layers == 2:  # the probe refreshed every layer: exact whatever was chosen
        n = len(SECOND)
        expected = reference_logits(hf, SECOND + hybrid.token_ids[:-1])
        assert (hybrid.logits[-len(hybrid.token_ids) :] - expected[n - 1 :]).abs().max() <= ATOL
