"""paged_attention with explicit query positions (``q_positions``), against fp64.

Each sequence's K/V is fully written (NaN everywhere else in the cache, as the engine leaves
unwritten memory); its query rows sit at arbitrary positions, in any order, and the row at
position ``p`` must see exactly keys ``0 .. p``.
"""

from __future__ import annotations

import math

import pytest
import torch
from support import paged_kv

from ragkv.errors import InvalidInputError
from ragkv.kernels import paged_attention, plan_attention

BACKENDS = ["torch", "triton"]


def make_batch(specs, *, block_size=8, kv_heads=2, group=2, head_dim=16, dtype=torch.float32,
               run=None, seed=0):  # fmt: skip
    """specs: (seq_len, positions of its query rows). Blocks are handed out permuted, or as
    runs of ``run`` consecutive blocks in reverse order (prefixes of several runs)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [seq_len for seq_len, _ in specs]
    num_blocks = sum(math.ceil(n / block_size) for n in seq_lens) + 3
    if run is None:
        order = torch.randperm(num_blocks, generator=gen)
    else:
        order = torch.cat(torch.arange(num_blocks).split(run)[::-1])
    k_cache, v_cache, table, kv = paged_kv(
        seq_lens, order, gen, block_size=block_size, kv_heads=kv_heads, head_dim=head_dim,
        dtype=dtype,
    )  # fmt: skip
    positions = [p for _, rows in specs for p in rows]
    cu = torch.tensor([0] + [len(rows) for _, rows in specs]).cumsum(0).to(torch.int32)
    q = torch.randn(len(positions), kv_heads * group, head_dim, generator=gen).to(dtype)
    lens = torch.tensor([seq_len for seq_len, _ in specs], dtype=torch.int32)
    return q, k_cache, v_cache, table, cu, lens, kv, positions


def reference(q, kv, cu, positions, scale):
    """softmax(QK^T * scale, keys 0..p visible to the row at position p) V, in fp64."""
    outs = []
    for i, (k, v) in enumerate(kv):
        start, end = int(cu[i]), int(cu[i + 1])
        qi = q[start:end].double()
        group = qi.shape[1] // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)
        v = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,khd->htk", qi, k) * scale
        rows = torch.tensor(positions[start:end])
        visible = torch.arange(k.shape[0])[None, :] <= rows[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("htk,khd->thd", scores.softmax(-1), v))
    return torch.cat(outs)


def run(backend, q, k_cache, v_cache, table, cu, lens, positions, *, with_plan=True):
    scale = q.shape[-1] ** -0.5
    if backend == "triton":
        q_positions = torch.tensor(positions, dtype=torch.int32)
        return paged_attention(
            q, k_cache, v_cache, table, cu, lens, scale, backend="triton", q_positions=q_positions
        )
    cu_list, lens_list = cu.tolist(), lens.tolist()
    plan = None
    if with_plan:  # as the engine's runner: one plan of the positions, shared by all layers
        plan = plan_attention(table, cu_list, lens_list, k_cache.shape[1], q.dtype, positions)
    return paged_attention(
        q, k_cache, v_cache, table, cu_list, lens_list, scale, backend="torch", plan=plan,
        q_positions=positions,
    )  # fmt: skip


def check(specs, backend, atol=1e-5, **kw):
    q, k_cache, v_cache, table, cu, lens, kv, positions = make_batch(specs, **kw)
    out = run(backend, q, k_cache, v_cache, table, cu, lens, positions)
    assert out.dtype == q.dtype and out.shape == q.shape
    expected = reference(q, kv, cu, positions, q.shape[-1] ** -0.5)
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=atol)


# Scattered, unsorted rows; a sequence recomputing its first and last tokens only; a lone
# query in the middle of a sequence; a plain decode and a plain prefill tail (default plan).
MIXED = [
    (21, [13, 2, 20, 7, 8, 9, 0]),
    (19, [0, 1, 18]),
    (12, [5]),
    (10, [9]),
    (17, [12, 13, 14, 15, 16]),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_scattered_unsorted_positions_match_reference(backend):
    check(MIXED, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("run_len", [1, 2])
def test_positions_after_a_prefix_of_block_runs_match_reference(backend, run_len):
    # The smallest position lies past several runs: the torch path attends those runs as an
    # unmasked prefix and masks the tail by position; one table has more than 8 runs.
    specs = [(40, [33, 39, 24, 25, 36]), (37, [30, 36]), (80, [70, 79, 64]), (9, [8])]
    check(specs, backend, run=run_len, kv_heads=1, group=3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_position_of_a_sequence_in_reverse_order_matches_reference(backend):
    check([(20, list(range(19, -1, -1))), (6, [3, 0, 5, 1, 4, 2])], backend, group=1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_scattered_query_spanning_tiles_matches_reference(backend):
    order = torch.randperm(45, generator=torch.Generator().manual_seed(5))[:36].tolist()
    check([(45, order)], backend, kv_heads=1, group=3, block_size=16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16_positions_match_reference(backend):
    check(MIXED, backend, dtype=torch.float16, atol=2e-3)


def test_bf16_torch_positions_match_reference():
    check(MIXED, "torch", dtype=torch.bfloat16, atol=2e-2)


LAST_ROWS = [(21, 21), (19, 6), (10, 1), (33, 1), (12, 1), (17, 4)]


@pytest.mark.parametrize("run_len", [None, 2])
def test_last_rows_as_positions_are_bit_identical_on_the_torch_path(run_len):
    specs = [(n, list(range(n - q_len, n))) for n, q_len in LAST_ROWS]
    q, k_cache, v_cache, table, cu, lens, _, positions = make_batch(specs, run=run_len)
    plain = paged_attention(q, k_cache, v_cache, table, cu.tolist(), lens.tolist(), 0.25)
    plan = plan_attention(table, cu.tolist(), lens.tolist(), 8, q.dtype, positions)
    assert all(mask is None or mask.shape[0] > 1 for *_, mask in plan.seqs)  # default masks
    with_positions = paged_attention(
        q, k_cache, v_cache, table, cu.tolist(), lens.tolist(), 0.25, plan=plan,
        q_positions=positions,
    )  # fmt: skip
    torch.testing.assert_close(with_positions, plain, atol=0, rtol=0)


def test_last_rows_as_positions_match_the_default_triton_kernel():
    specs = [(n, list(range(n - q_len, n))) for n, q_len in LAST_ROWS]
    q, k_cache, v_cache, table, cu, lens, _, positions = make_batch(specs)
    plain = paged_attention(q, k_cache, v_cache, table, cu, lens, 0.25, backend="triton")
    with_positions = paged_attention(
        q, k_cache, v_cache, table, cu, lens, 0.25, backend="triton",
        q_positions=torch.tensor(positions, dtype=torch.int32),
    )  # fmt: skip
    torch.testing.assert_close(with_positions, plain, atol=1e-6, rtol=1e-6)


def test_a_position_outside_its_sequence_is_refused():
    q, k_cache, v_cache, table, cu, lens, _, positions = make_batch([(10, [3, 9]), (6, [5])])
    for bad in ([3, 10, 5], [3, 9, -1]):
        with pytest.raises(InvalidInputError) as err:
            run("torch", q, k_cache, v_cache, table, cu, lens, bad)
        assert err.value.param == "q_positions"
    with pytest.raises(InvalidInputError):  # one position per query row
        paged_attention(q, k_cache, v_cache, table, cu, lens, 0.25, q_positions=[3, 9])


def test_a_plan_of_other_positions_is_refused():
    q, k_cache, v_cache, table, cu, lens, _, positions = make_batch([(10, [3, 9]), (6, [5])])
    cu_list, lens_list = cu.tolist(), lens.tolist()
    for plan_positions in (None, [2, 9, 5]):
        plan = plan_attention(table, cu_list, lens_list, 8, q.dtype, plan_positions)
        with pytest.raises(InvalidInputError):
            paged_attention(
                q, k_cache, v_cache, table, cu_list, lens_list, 0.25, plan=plan,
                q_positions=positions,
            )  # fmt: skip
    # the plan carries its positions: a caller that passes only the plan gets them
    plan = plan_attention(table, cu_list, lens_list, 8, q.dtype, positions)
    out = paged_attention(q, k_cache, v_cache, table, cu_list, lens_list, 0.25, plan=plan)
    want = run("torch", q, k_cache, v_cache, table, cu, lens, positions, with_plan=False)
    torch.testing.assert_close(out, want, atol=0, rtol=0)


def test_positions_over_consecutive_blocks_match_reference():
    # One run of blocks: each positioned sequence reads its keys as a view, not a gather.
    check(MIXED, "torch", run=1000)
