"""The engine's outputs equal a plain Hugging Face forward, with and without cache hits.

Every supported family is exercised on a tiny random-weight checkpoint saved to disk and
loaded through ``Engine.from_pretrained``. Logits are compared per computed position
(fp32, max abs diff <= 1e-4); greedy tokens must be identical.
"""

from __future__ import annotations

import pytest
import torch
from support import FAMILIES, ids, reference_logits, save_tiny_checkpoint

from ragkv.cache_engine import Engine, SamplingParams

ATOL = 1e-4
BLOCK = 16


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    family = request.param
    path = save_tiny_checkpoint(tmp_path_factory.mktemp(family), family, seed=1)
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, reference


def make_engine(path, **kwargs) -> Engine:
    kwargs.setdefault("kv_cache_tokens", 4096)
    kwargs.setdefault("block_size", BLOCK)
    return Engine.from_pretrained(path, device="cpu", **kwargs)


def assert_logits_match(model, out) -> None:
    """The engine's kept rows equal the HF forward of prompt + output at the same positions."""
    full = out.prompt_token_ids + out.token_ids[:-1]
    expected = reference_logits(model, full)[out.logits_start :]
    assert out.logits is not None and out.logits.shape == expected.shape
    diff = (out.logits - expected).abs().max().item()
    assert diff <= ATOL, f"max abs logit diff {diff}"


def test_cold_prompt_logits_match_hf_forward(checkpoint):
    path, model = checkpoint
    with make_engine(path) as engine:
        out = engine.generate(ids(0, 70), SamplingParams(max_tokens=5), return_logits=True)
    assert out.usage.cached_tokens == 0 and out.logits_start == 0
    assert_logits_match(model, out)


def test_full_hit_recomputes_only_the_last_token(checkpoint):
    path, model = checkpoint
    prompt = ids(1, 64)  # a whole number of blocks: the cap of len - 1 tokens bites
    with make_engine(path) as engine:
        cold = engine.generate(prompt, SamplingParams(max_tokens=4))
        warm = engine.generate(prompt, SamplingParams(max_tokens=4), return_logits=True)
    assert warm.usage.cached_tokens == 48  # (64 - 1) // 16 full blocks
    assert warm.logits_start == 48
    assert_logits_match(model, warm)
    assert warm.token_ids == cold.token_ids


def test_shared_90_percent_prefix_is_reused_block_by_block(checkpoint):
    path, model = checkpoint
    base = ids(2, 100)
    other = base[:90] + ids(3, 10)
    with make_engine(path) as engine:
        engine.generate(base, SamplingParams(max_tokens=2))
        out = engine.generate(other, SamplingParams(max_tokens=6), return_logits=True)
    assert out.usage.cached_tokens == 80  # 90 shared tokens -> 5 full blocks of 16
    assert_logits_match(model, out)


def test_mixed_batch_of_cold_warm_and_decoding_requests_matches(checkpoint):
    path, model = checkpoint
    warm_prompt = ids(4, 50)
    # A small token budget splits prefills over steps while earlier requests decode, so
    # steps mix decode tokens, chunked prefills and cache-hit prefills.
    with make_engine(path, max_num_batched_tokens=40) as engine:
        engine.generate(warm_prompt, SamplingParams(max_tokens=1))
        prompts = [ids(5, 30), warm_prompt, ids(6, 90), warm_prompt[:40] + ids(7, 5)]
        outs = engine.generate(prompts, SamplingParams(max_tokens=8), return_logits=True)
    assert [o.usage.cached_tokens for o in outs] == [0, 48, 0, 32]
    for out in outs:
        assert_logits_match(model, out)


def test_chunked_prefill_matches_one_shot_prefill(checkpoint):
    path, model = checkpoint
    prompt = ids(8, 150)
    with make_engine(path, max_num_batched_tokens=24) as engine:
        out = engine.generate(prompt, SamplingParams(max_tokens=4), return_logits=True)
        assert engine.stats().steps >= 150 // 24
    assert_logits_match(model, out)


def test_preempted_requests_are_recomputed_exactly(checkpoint):
    path, model = checkpoint
    # 10 blocks of 16 tokens; four requests growing to 50 tokens (4 blocks) each cannot all fit.
    prompts = [ids(10 + i, 30) for i in range(4)]
    with make_engine(path, kv_cache_tokens=10 * BLOCK) as engine:
        outs = engine.generate(
            prompts, SamplingParams(max_tokens=20, ignore_eos=True), return_logits=True
        )
        assert engine.stats().preemptions > 0
    assert any(o.num_preemptions for o in outs)
    with make_engine(path, enable_prefix_caching=False) as engine:
        alone = [
            engine.generate(p, SamplingParams(max_tokens=20, ignore_eos=True)) for p in prompts
        ]
    for out, ref in zip(outs, alone, strict=True):
        assert_logits_match(model, out)
        assert out.token_ids == ref.token_ids


def test_greedy_equals_hf_generate_with_and_without_prefix_caching(checkpoint):
    path, model = checkpoint
    prompt = ids(20, 40)
    expected = model.generate(
        torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None
    )[0, len(prompt) :].tolist()
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for caching in (True, False):
        with make_engine(path, enable_prefix_caching=caching) as engine:
            first = engine.generate(prompt, params)
            second = engine.generate(prompt, params)
        assert first.token_ids == expected
        assert second.token_ids == expected
        assert second.usage.cached_tokens == (32 if caching else 0)


def test_different_cache_salt_never_shares_blocks(checkpoint):
    path, _ = checkpoint
    prompt = ids(30, 64)
    with make_engine(path) as engine:
        engine.generate(prompt, SamplingParams(max_tokens=1), cache_salt="tenant-a")
        other = engine.generate(prompt, SamplingParams(max_tokens=1), cache_salt="tenant-b")
        unsalted = engine.generate(prompt, SamplingParams(max_tokens=1))
        same = engine.generate(prompt, SamplingParams(max_tokens=1), cache_salt="tenant-a")
    assert other.usage.cached_tokens == 0
    assert unsalted.usage.cached_tokens == 0
    assert same.usage.cached_tokens == 48


def test_blocks_completed_by_generated_tokens_are_cached(checkpoint):
    path, _ = checkpoint
    prompt = ids(40, 20)
    with make_engine(path) as engine:
        first = engine.generate(prompt, SamplingParams(max_tokens=30, ignore_eos=True))
        follow_up = prompt + first.token_ids + ids(41, 3)
        out = engine.generate(follow_up, SamplingParams(max_tokens=1))
    # prompt + 29 computed outputs = 49 tokens with K/V -> 3 full blocks cached
    assert out.usage.cached_tokens == 48
