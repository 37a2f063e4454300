"""store_kv writes each token to its slot, skips padding, and touches nothing else."""

from __future__ import annotations

import pytest
import torch

from ragkv.kernels import store_kv

BLOCK_SIZE, KV_HEADS, HEAD_DIM = 8, 2, 80


def expected_after(k_cache, key, slots):
    want = k_cache.clone()
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = key[token]
    return want


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_tokens_land_in_their_slots_and_padding_is_skipped(backend, dtype):
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(6, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v_cache = torch.randn(6, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    key = torch.randn(7, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    value = torch.randn(7, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    # Crosses a block boundary (39 -> 40 is block 4 -> 5), starts mid-block, has padding.
    slots = torch.tensor([3, 37, 38, 39, -1, 40, -1])
    want_k, want_v = expected_after(k_cache, key, slots), expected_after(v_cache, value, slots)

    store_kv(key, value, k_cache, v_cache, slots, backend=backend)

    assert torch.equal(k_cache, want_k)
    assert torch.equal(v_cache, want_v)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_caches_viewed_out_of_a_joint_kv_tensor_are_written_in_place(backend):
    # k_cache = kv[:, 0] has a block stride of two blocks: no flat view over the slots exists.
    kv = torch.zeros(4, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = kv[:, 0], kv[:, 1]
    key, value = torch.randn(3, KV_HEADS, HEAD_DIM), torch.randn(3, KV_HEADS, HEAD_DIM)
    slots = torch.tensor([9, -1, 31])
    want_k, want_v = expected_after(k_cache, key, slots), expected_after(v_cache, value, slots)

    store_kv(key, value, k_cache, v_cache, slots, backend=backend)

    assert torch.equal(kv[:, 0], want_k)
    assert torch.equal(kv[:, 1], want_v)


def test_all_padding_writes_nothing():
    k_cache, v_cache = (
        torch.zeros(2, BLOCK_SIZE, KV_HEADS, HEAD_DIM),
        torch.zeros(2, BLOCK_SIZE, KV_HEADS, HEAD_DIM),
    )
    key = torch.ones(2, KV_HEADS, HEAD_DIM)
    store_kv(key, key, k_cache, v_cache, torch.tensor([-1, -1]))
    assert not k_cache.any() and not v_cache.any()
