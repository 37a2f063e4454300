"""paged_attention against an independent fp64 reference, on both backends.

Every cache starts filled with NaN and only the sequences' tokens are written, as the engine
does, so any read of padding, of a table entry past a sequence, or of an unwritten slot
poisons the output.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from support import paged_kv

from ragkv.kernels import paged_attention, plan_attention, store_kv

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BACKENDS = ["torch", "triton"]


def make_batch(specs, *, block_size=8, kv_heads=2, group=2, head_dim=16, dtype=torch.float32,
               num_blocks=None, permute=True, run=None, seed=0):  # fmt: skip
    """A paged batch: specs are (seq_len, q_len); returns q, caches, table, cu, lens, kv.

    Blocks are handed out in random order (``permute``), in order, or, with ``run=n``, as
    runs of ``n`` consecutive blocks in reverse order (tables made of several runs).
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [seq_len for seq_len, _ in specs]
    num_blocks = num_blocks or sum(math.ceil(n / block_size) for n in seq_lens) + 3
    order = torch.randperm(num_blocks, generator=gen) if permute else torch.arange(num_blocks)
    if run is not None:
        order = torch.cat(torch.arange(num_blocks).split(run)[::-1])
    k_cache, v_cache, table, kv = paged_kv(
        seq_lens, order, gen, block_size=block_size, kv_heads=kv_heads, head_dim=head_dim,
        dtype=dtype,
    )  # fmt: skip
    cu = torch.tensor([0] + [q_len for _, q_len in specs], dtype=torch.int32).cumsum(0)
    q = torch.randn(int(cu[-1]), kv_heads * group, head_dim, generator=gen).to(dtype)
    lens = torch.tensor([seq_len for seq_len, _ in specs], dtype=torch.int32)
    return q, k_cache, v_cache, table, cu.to(torch.int32), lens, kv


def reference(q, kv, cu, scale):
    """softmax(QK^T * scale + causal mask) V in fp64, from the unpaged K/V."""
    outs = []
    for i, (k, v) in enumerate(kv):
        qi = q[int(cu[i]) : int(cu[i + 1])].double()
        group = qi.shape[1] // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)
        v = v.double().repeat_interleave(group, dim=1)
        q_len, kv_len = qi.shape[0], k.shape[0]
        scores = torch.einsum("thd,khd->htk", qi, k) * scale
        visible = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("htk,khd->thd", scores.softmax(-1), v))
    return torch.cat(outs)


def check(specs, backend, atol=1e-5, **kw):
    q, k_cache, v_cache, table, cu, lens, kv = make_batch(specs, **kw)
    scale = q.shape[-1] ** -0.5
    # The torch path gets its plan from the caller, as the engine's model runner does.
    plan = (
        plan_attention(table, cu, lens, k_cache.shape[1], q.dtype) if backend == "torch" else None
    )
    out = paged_attention(q, k_cache, v_cache, table, cu, lens, scale, backend=backend, plan=plan)
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), reference(q, kv, cu, scale), atol=atol, rtol=atol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_prefill_chunk_and_decode_batch_matches_reference(backend):
    # full prefill across blocks, a 6-token chunk starting mid-block (at 13), decodes
    check([(21, 21), (19, 6), (10, 1), (1, 1)], backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("permute", [True, False], ids=["permuted", "consecutive"])
def test_all_decode_batch_with_mqa_matches_reference(backend, permute):
    check([(9, 1), (17, 1), (3, 1), (16, 1)], backend, kv_heads=1, group=4, permute=permute)


@pytest.mark.parametrize("backend", BACKENDS)
def test_head_dim_80_without_gqa_matches_reference(backend):
    check([(12, 5), (7, 1)], backend, kv_heads=2, group=1, head_dim=80, block_size=16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16_matches_reference(backend):
    check([(20, 7), (11, 1)], backend, dtype=torch.float16, atol=2e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_query_spanning_several_tiles_matches_reference(backend):
    # 40 queries with 3 heads per KV head span several query tiles and KV tiles.
    check([(45, 40)], backend, kv_heads=1, group=3, block_size=16)


def test_bf16_torch_path_matches_reference():
    check([(20, 7), (11, 1), (9, 1)], "torch", dtype=torch.bfloat16, atol=2e-2)


@pytest.mark.skipif(
    INTERPRETED or not torch.cuda.is_available(),
    reason="the Triton interpreter computes bf16 wrongly (numpy has no bf16); needs a CUDA GPU",
)
def test_bf16_triton_path_matches_reference():  # pragma: no cover - GPU only
    check([(20, 7), (11, 1)], "triton", dtype=torch.bfloat16, atol=2e-2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("run", [1, 2, 3])
def test_tables_of_several_consecutive_runs_match_reference(backend, run):
    # prefills with and without a cached prefix, partial and full last blocks, decodes; on
    # the torch path a prefix of runs is attended run by run, or gathered past 8 runs (80, 5)
    specs = [(40, 40), (37, 9), (33, 1), (24, 1), (8, 1), (29, 2), (17, 1), (80, 5)]
    check(specs, backend, run=run, kv_heads=1, group=3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("run", [1, 2])
def test_a_query_as_long_as_a_prefix_run_sees_that_whole_run(backend, run):
    # Regression: the torch path inferred "causal" from q_len == key count, so a cached
    # prefix run exactly as long as the query chunk was masked causally (wrong outputs for a
    # prompt whose uncached suffix is one block, over scattered cached blocks).
    tokens = 8 * run
    specs = [(4 * tokens, tokens), (3 * tokens, tokens), (2 * tokens + 3, tokens + 3)]
    check(specs, backend, run=run)


def test_runs_of_a_cached_prefix_in_bf16_match_reference():
    check([(37, 9), (29, 2), (9, 1)], "torch", run=2, dtype=torch.bfloat16, atol=2e-2)


def test_one_plan_serves_every_layer_of_a_step():
    q, k_cache, v_cache, table, cu, lens, kv = make_batch([(19, 6), (10, 1), (12, 1), (9, 1)])
    plan = plan_attention(table, cu.tolist(), lens.tolist(), k_cache.shape[1], q.dtype)
    expected = reference(q, kv, cu, 0.25)
    for layer in range(3):  # other caches of the same layout, as each layer has its own
        k_layer, v_layer = k_cache * (layer + 1), v_cache
        out = paged_attention(q, k_layer, v_layer, table, cu, lens, 0.25, plan=plan)
        scaled = [(k * (layer + 1), v) for k, v in kv]
        want = expected if layer == 0 else reference(q, scaled, cu, 0.25)
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_a_table_edited_in_place_gets_a_new_plan_from_its_caller():
    q, k_cache, v_cache, table, cu, lens, kv = make_batch([(19, 6), (10, 1), (12, 1)])
    paged_attention(q, k_cache, v_cache, table, cu.tolist(), lens.tolist(), 0.25)
    # Move sequence 0's first block elsewhere: same metadata lists, same table object.
    used = {int(b) for row, n in zip(table, (lens + 7) // 8, strict=True) for b in row[:n]}
    old, new = int(table[0, 0]), min(set(range(k_cache.shape[0])) - used)
    k_cache[new], v_cache[new] = k_cache[old], v_cache[old]
    k_cache[old], v_cache[old] = float("nan"), float("nan")
    table[0, 0] = new
    plan = plan_attention(table, cu, lens, k_cache.shape[1], q.dtype)
    out = paged_attention(q, k_cache, v_cache, table, cu.tolist(), lens.tolist(), 0.25, plan=plan)
    torch.testing.assert_close(out.double(), reference(q, kv, cu, 0.25), atol=1e-5, rtol=1e-5)


def test_metadata_as_python_lists_matches_tensors():
    q, k_cache, v_cache, table, cu, lens, _ = make_batch([(19, 6), (10, 1), (12, 1)])
    as_tensors = paged_attention(q, k_cache, v_cache, table, cu, lens, 0.25)
    as_lists = paged_attention(q, k_cache, v_cache, table, cu.tolist(), lens.tolist(), 0.25)
    torch.testing.assert_close(as_lists, as_tensors, atol=0, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_ids_past_int32_element_offsets_are_addressed(backend):
    # Block id * block stride > 2**31 elements: int32 offsets would wrap. The 4 GiB cache is
    # virtual memory; only the pages of the blocks written here are touched.
    block_size, head_dim = 8, 16
    num_blocks = 2**31 // (block_size * head_dim) + 2
    try:
        cache = torch.empty(num_blocks, block_size, 1, head_dim, dtype=torch.float16)
    except RuntimeError:
        pytest.skip("cannot reserve 4 GiB of virtual memory here")
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(12, 1, head_dim, generator=gen).half()
    table = torch.tensor([[num_blocks - 1, 3]], dtype=torch.int32)
    slots = torch.cat([torch.arange(8) + (num_blocks - 1) * block_size, torch.arange(4) + 24])
    store_kv(k, k, cache, cache, slots, backend=backend)
    q = torch.randn(2, 2, head_dim, generator=gen).half()
    cu, lens = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([12], dtype=torch.int32)
    out = paged_attention(q, cache, cache, table, cu, lens, 0.25, backend=backend)
    torch.testing.assert_close(out.double(), reference(q, [(k, k)], cu, 0.25), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("permute", [True, False], ids=["permuted", "consecutive"])
def test_decodes_of_unequal_lengths_share_padded_calls(permute):
    # Lengths around block edges (block_size 8): the gather is padded to the longest, the
    # slots past each shorter sequence are masked, and a NaN read anywhere shows.
    specs = [(1, 1), (7, 1), (8, 1), (9, 1), (16, 1), (33, 1), (17, 1)]
    q, k_cache, v_cache, table, cu, lens, _ = make_batch(specs, permute=permute)
    plan = plan_attention(table, cu, lens, k_cache.shape[1], q.dtype)
    # Batches of sequences longer than half their longest: 33 17 | 16 9 | 8 7 | 1.
    assert [len(batch.rows) for batch in plan.decodes] == [2, 2, 2, 1] and not plan.seqs
    check(specs, "torch", permute=permute, kv_heads=3, group=3)


@pytest.mark.parametrize("specs", [[(29, 1)], [(21, 1)] * 3], ids=["one", "equal-lengths"])
def test_decodes_over_consecutive_blocks_are_gathered_and_match_reference(specs):
    check(specs, "torch", permute=False, kv_heads=3, group=3)


@pytest.mark.parametrize("seed", range(12))
def test_random_batches_of_odd_shapes_match_a_dense_reference(seed):
    # Several sequences per step, each a decode, a chunk over a cached prefix or a full
    # prefill, over permuted blocks, reversed runs or consecutive ones; GQA, MQA and MHA.
    rng = torch.Generator().manual_seed(seed)

    def draw(n: int) -> int:
        return int(torch.randint(n, (), generator=rng))

    specs = []
    for _ in range(1 + draw(5)):
        seq_len = 1 + draw(70)
        q_len = (1, seq_len, 1 + draw(seq_len))[draw(3)]
        specs.append((seq_len, q_len))
    layout = [{"permute": True}, {"permute": False}, {"run": 1 + draw(4)}][draw(3)]
    shape = {
        "kv_heads": 1 + draw(3),
        "group": (1, 2, 3)[draw(3)],
        "block_size": (4, 8, 16)[draw(3)],
    }
    q, k_cache, v_cache, table, cu, lens, _ = make_batch(specs, seed=seed, **layout, **shape)
    plan = plan_attention(table, cu, lens, k_cache.shape[1], q.dtype)
    decodes = sum(q_len == 1 for _, q_len in specs)
    assert len(plan.seqs) == len(specs) - decodes  # one SDPA call per other sequence
    check(specs, "torch", seed=seed, **layout, **shape)
