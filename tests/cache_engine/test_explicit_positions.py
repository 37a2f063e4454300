"""Steps that compute a prompt's tokens at explicit, scattered positions
(``ScheduledSlice.positions``) give the logits of a plain Hugging Face forward.

The model runner is driven directly, as the engine's chunk reuse drives it: no scheduler,
hand-made block tables (scattered blocks), K/V of the positions not computed in a step
already in the cache.
"""

from __future__ import annotations

import pytest
import torch
from support import reference_logits, save_tiny_checkpoint

from ragkv.cache_engine.model_runner import ModelRunner
from ragkv.cache_engine.request import Request
from ragkv.cache_engine.sampling_params import SamplingParams
from ragkv.cache_engine.step import ScheduledSlice, SchedulerOutput
from ragkv.errors import InvalidInputError

BLOCK = 4
ATOL = 1e-4  # fp32, as the engine's other exactness tests


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = save_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=5)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def make_runner(path) -> ModelRunner:
    runner = ModelRunner(
        path, device=torch.device("cpu"), dtype=torch.float32, block_size=BLOCK, num_blocks=24
    )
    for k_cache, v_cache in runner.kv_caches:  # unwritten memory must never be read
        k_cache.fill_(float("nan"))
        v_cache.fill_(float("nan"))
    return runner


def make_request(name: str, n: int, seed: int) -> Request:
    ids = torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return Request(name, ids, SamplingParams(max_tokens=1), keep_logits=True)


def step(runner: ModelRunner, *chunks: ScheduledSlice):
    return runner.execute(SchedulerOutput(slices=list(chunks)))


def test_a_prompt_computed_out_of_order_across_two_steps_matches_hf(checkpoint):
    path, model = checkpoint
    runner = make_runner(path)
    req = make_request("a", 16, seed=1)
    table = [9, 3, 7, 1]  # scattered blocks
    first = [0, 1, 2, 3, 4, 5, 6, 7]
    second = [12, 13, 14, 15, 8, 9, 10, 11]  # position 12 attends to keys 8..11 of this step
    # A plain prefill of another request shares the second step (its rows keep the default
    # "last q_len positions" semantics inside a step that passes explicit positions).
    other = make_request("b", 10, seed=2)
    out1 = step(runner, ScheduledSlice(req, 0, 8, table, positions=first))
    out2 = step(
        runner,
        ScheduledSlice(req, 8, 8, table, positions=second),
        ScheduledSlice(other, 0, 10, [20, 12, 5]),
    )
    expected = reference_logits(model, req.token_ids)
    torch.testing.assert_close(out1.logits[0], expected[first], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(out2.logits[0], expected[second], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(
        out2.logits[1], reference_logits(model, other.token_ids), atol=ATOL, rtol=ATOL
    )
    # the first step samples nothing; the second samples from position 15 (not its last row)
    assert out1.token_ids == []
    assert out2.token_ids[0] == int(expected[15].argmax())


def test_scattered_positions_recomputed_over_placed_kv_match_hf(checkpoint):
    # As chunk reuse does: a sequence's K/V is placed in its blocks (here copied from the
    # same prompt computed elsewhere), then a scattered subset is recomputed in one step,
    # its slots poisoned first so only this step's K/V can make the result right.
    path, model = checkpoint
    runner = make_runner(path)
    req = make_request("a", 18, seed=3)
    source, target = [0, 1, 2, 3, 4], [14, 10, 11, 6, 17]
    step(runner, ScheduledSlice(make_request("src", 18, seed=3), 0, 18, source))
    recompute = [13, 2, 7, 17, 0]
    slots = torch.tensor([target[p // BLOCK] * BLOCK + p % BLOCK for p in recompute])
    for k_cache, v_cache in runner.kv_caches:
        for cache in (k_cache, v_cache):
            cache[target] = cache[source]
            cache.view(-1, *cache.shape[2:])[slots] = float("nan")
    out = step(runner, ScheduledSlice(req, 18 - len(recompute), len(recompute), target, recompute))
    expected = reference_logits(model, req.token_ids)
    torch.testing.assert_close(out.logits[0], expected[recompute], atol=ATOL, rtol=ATOL)
    assert out.token_ids == [int(expected[17].argmax())]


def test_a_sampling_slice_without_its_last_position_is_refused(checkpoint):
    runner = make_runner(checkpoint[0])
    req = make_request("a", 8, seed=4)
    with pytest.raises(InvalidInputError) as err:
        runner.prepare([ScheduledSlice(req, 1, 7, [0, 1], positions=[0, 1, 2, 3, 4, 5, 6])])
    assert err.value.param == "positions"
    # one distinct position per computed token, each below the slice's end
    for positions in ([4, 5, 8, 7], [4, 5, 6], [7, 5, 5, 6]):
        with pytest.raises(InvalidInputError):
            runner.prepare([ScheduledSlice(req, 4, 4, [0, 1], positions=positions)])
