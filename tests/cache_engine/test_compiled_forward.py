"""The compiled forward (``EngineConfig.compile``) computes what the eager one does.

One compiled engine for the module (compiling is the slow part: the engine compiles each
of its graphs once, at start); every test compares it with an eager engine on the same
tiny random-weight checkpoint, and with a plain Hugging Face forward. Logits within 1e-4
(fp32), greedy tokens identical, and no request compiles anything.
"""

from __future__ import annotations

import pytest
import torch
from support import ids, reference_logits

from ragkv.cache_engine import Engine, SamplingParams
from ragkv.errors import RagkvError

ATOL = 1e-4
pytestmark = pytest.mark.slow  # compiling takes 10-30 s on 2 cores


def make_engine(path, **kwargs) -> Engine:
    return Engine.from_pretrained(path, device="cpu", kv_cache_tokens=4096, block_size=16, **kwargs)


@pytest.fixture(scope="module")
def compiled(llama_dir):
    with make_engine(llama_dir, compile=True) as engine:
        yield engine


@pytest.fixture(scope="module")
def reference(llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()


def graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def test_compiled_batches_match_eager_and_hf_without_compiling_again(
    compiled, llama_dir, reference
):
    warm = ids(4, 50)
    # Cold, cache-hit and chunked prefills next to decodes of one and of many requests.
    prompts = [ids(5, 30), warm, ids(6, 90), warm[:40] + ids(7, 5)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    before = graphs_compiled()
    assert before > 0  # the engine compiled its graphs when it started
    outs = {}
    for name, engine in (("compiled", compiled), ("eager", make_engine(llama_dir))):
        engine.generate(warm, SamplingParams(max_tokens=1))
        outs[name] = engine.generate(prompts, params, return_logits=True)
        single = engine.generate(ids(8, 20), params, return_logits=True)  # batch of one
        outs[name].append(single)
        if name == "eager":
            engine.close()
    assert graphs_compiled() == before  # every shape was compiled at engine start
    for fast, slow in zip(outs["compiled"], outs["eager"], strict=True):
        assert fast.token_ids == slow.token_ids
        assert fast.usage.cached_tokens == slow.usage.cached_tokens
        assert (fast.logits - slow.logits).abs().max().item() <= ATOL
        full = fast.prompt_token_ids + fast.token_ids[:-1]
        expected = reference_logits(reference, full)[fast.logits_start :]
        assert (fast.logits - expected).abs().max().item() <= ATOL


def test_compiled_greedy_equals_hf_generate(compiled, reference):
    prompt = ids(20, 40)
    expected = reference.generate(
        torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None
    )[0, len(prompt) :].tolist()
    out = compiled.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    assert out.token_ids == expected


def test_attention_op_outside_a_step_says_how_to_run_the_model():
    q = torch.zeros(1, 4, 2, 16)
    kv = torch.zeros(1, 2, 2, 16)
    with pytest.raises(RagkvError, match="through ragkv.cache_engine.Engine"):
        torch.ops.ragkv.paged_attention(q, kv, kv, 0, 0.25)
