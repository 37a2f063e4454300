"""Linears packed for oneDNN (``EngineConfig.prepack_linear``, on by default on CPU fp32)
compute what the BLAS linears do: logits within 1e-4, greedy tokens identical."""

from __future__ import annotations

import torch
from support import ids

from ragkv.cache_engine import Engine, SamplingParams
from ragkv.cache_engine.packed_linear import can_prepack, prepack_linears

ATOL = 1e-4


def test_packed_engine_matches_blas_engine(llama_dir):
    warm = ids(4, 50)
    prompts = [ids(5, 30), warm, ids(6, 90), warm[:40] + ids(7, 5)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    outs = {}
    for packed in (True, False):
        with Engine.from_pretrained(
            llama_dir, device="cpu", kv_cache_tokens=4096, block_size=16, prepack_linear=packed
        ) as engine:
            assert engine.runner.prepacked is packed
            engine.generate(warm, SamplingParams(max_tokens=1))
            outs[packed] = engine.generate(prompts, params, return_logits=True)
    for fast, slow in zip(outs[True], outs[False], strict=True):
        assert fast.token_ids == slow.token_ids
        assert (fast.logits - slow.logits).abs().max().item() <= ATOL


def test_packing_leaves_the_model_state_alone():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 8)
    expected = model(x)
    assert prepack_linears(model) == 2
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert (model(x) - expected).abs().max().item() <= 1e-5
    assert (model(x.t().contiguous().t()) - expected).abs().max().item() <= 1e-5  # a view


def test_packing_is_for_float32_on_cpu_only():
    cpu = torch.device("cpu")
    assert can_prepack(cpu, torch.float32) == torch.backends.mkldnn.is_available()
    assert not can_prepack(cpu, torch.bfloat16)
    assert not can_prepack(torch.device("cuda"), torch.float32)
