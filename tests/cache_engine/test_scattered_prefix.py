"""A cached prefix over scattered blocks, with an uncached suffix exactly one run long.

Regression: the CPU attention path inferred a causal mask from "query chunk as long as the
key segment", so a cached prefix run of exactly ``q_len`` tokens was masked causally. A
prompt whose length is a multiple of the block size, re-sent after its blocks were handed
out in descending order (a finished request frees its blocks tail first), decoded wrongly.
"""

from __future__ import annotations

import pytest
import torch
from support import ids, reference_logits, save_tiny_checkpoint

from ragkv.cache_engine import Engine, SamplingParams

BLOCK = 16


def assert_logits_match(model, out) -> None:
    """The engine's kept rows equal the HF forward of prompt + output (fp32, 1e-4)."""
    full = out.prompt_token_ids + out.token_ids[:-1]
    expected = reference_logits(model, full)[out.logits_start :]
    assert (out.logits - expected).abs().max().item() <= 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = save_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=4)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_a_hit_over_descending_blocks_with_a_one_block_suffix_is_exact(checkpoint):
    path, model = checkpoint
    # Eight blocks: the first request takes all of them and frees them tail first, so the
    # next request gets its blocks in descending order (runs of one block each).
    with Engine.from_pretrained(path, device="cpu", kv_cache_tokens=8 * BLOCK) as engine:
        engine.generate(ids(1, 7 * BLOCK + 4), SamplingParams(max_tokens=1))
        prompt = ids(2, 3 * BLOCK)  # a multiple of the block size: the last block recomputed
        params = SamplingParams(max_tokens=6)
        first = engine.generate(prompt, params, return_logits=True)
        again = engine.generate(prompt, params, return_logits=True)
    assert first.usage.cached_tokens == 0 and again.usage.cached_tokens == 2 * BLOCK
    assert_logits_match(model, first)
    assert_logits_match(model, again)
    assert again.token_ids == first.token_ids
