"""GPU lane: Triton paged attention vs SDPA (and flash-attn varlen if installed).

7B-class shapes (32 query heads, 8 KV heads, head_dim 128, bf16, block size 16):
prefill of a 256-token chunk over a 2k cached prefix (batch 4), and decode of 64 sequences of
2k tokens. First checks store_kv and paged_attention (Triton) against the torch reference,
then times with CUDA events. Runs in well under 5 minutes on one GPU.

    python benchmarks/kernels_gpu.py [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from ragkv.kernels import paged_attention, store_kv

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16


def cuda_ms(fn, repeats: int = 20) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` CUDA-event-timed runs."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def make_case(num_seqs: int, seq_len: int, q_len: int, gen: torch.Generator) -> dict:
    """A batch whose blocks are permuted across the pool, filled through store_kv."""
    n = seq_len // BLOCK_SIZE
    num_blocks = num_seqs * n + 16
    dev = "cuda"
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.empty(shape, dtype=DTYPE, device=dev)
    v_cache = torch.empty(shape, dtype=DTYPE, device=dev)
    table = torch.randperm(num_blocks, generator=gen)[: num_seqs * n].view(num_seqs, n)
    table = table.to(device=dev, dtype=torch.int32)
    slots = (table.long()[:, :, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device=dev)).flatten()
    k = torch.randn(slots.numel(), KV_HEADS, HEAD_DIM, device=dev, dtype=DTYPE)
    v = torch.randn(slots.numel(), KV_HEADS, HEAD_DIM, device=dev, dtype=DTYPE)
    store_kv(k, v, k_cache, v_cache, slots, backend="triton")
    cu = torch.arange(0, (num_seqs + 1) * q_len, q_len, device=dev, dtype=torch.int32)
    lens = torch.full((num_seqs,), seq_len, device=dev, dtype=torch.int32)
    q = torch.randn(num_seqs * q_len, HEADS, HEAD_DIM, device=dev, dtype=DTYPE)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, table=table, cu=cu, lens=lens,
                k=k.view(num_seqs, seq_len, KV_HEADS, HEAD_DIM),
                v=v.view(num_seqs, seq_len, KV_HEADS, HEAD_DIM), q_len=q_len, seq_len=seq_len)  # fmt: skip


def check(case: dict, scale: float) -> float:
    """Max abs difference between the Triton kernel and the torch reference."""
    args = (case["q"], case["k_cache"], case["v_cache"], case["table"], case["cu"], case["lens"])
    got = paged_attention(*args, scale, max_seqlen_q=case["q_len"], backend="triton")
    want = paged_attention(*args, scale, backend="torch")
    return (got.float() - want.float()).abs().max().item()


def time_case(case: dict, scale: float) -> dict:
    num_seqs, q_len, seq_len = case["lens"].numel(), case["q_len"], case["seq_len"]
    args = (case["q"], case["k_cache"], case["v_cache"], case["table"], case["cu"], case["lens"])
    res = {
        "triton_ms": cuda_ms(
            lambda: paged_attention(*args, scale, max_seqlen_q=q_len, max_seqlen_k=seq_len)
        )
    }
    qs = case["q"].view(num_seqs, q_len, HEADS, HEAD_DIM).transpose(1, 2)
    ks, vs = case["k"].transpose(1, 2).contiguous(), case["v"].transpose(1, 2).contiguous()
    mask = None
    if 1 < q_len < seq_len:
        mask = torch.ones(q_len, seq_len, dtype=torch.bool, device="cuda").tril(seq_len - q_len)
    res["sdpa_contiguous_ms"] = cuda_ms(
        lambda: F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True
        )
    )
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        res["flash_attn_varlen_ms"] = None
        return res
    cu_k = torch.arange(0, (num_seqs + 1) * seq_len, seq_len, device="cuda", dtype=torch.int32)
    kf, vf = case["k"].flatten(0, 1), case["v"].flatten(0, 1)
    res["flash_attn_varlen_ms"] = cuda_ms(
        lambda: flash_attn_varlen_func(
            case["q"], kf, vf, case["cu"], cu_k, q_len, seq_len, softmax_scale=scale, causal=True
        )  # fmt: skip
    )
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit(
            "kernels_gpu.py needs a CUDA GPU (none found); run benchmarks/kernels_cpu.py on CPU."
        )
    gen = torch.Generator().manual_seed(0)
    scale = HEAD_DIM**-0.5
    cases = {"prefill 4 x (2048 + 256)": (4, 2304, 256), "decode 64 x 2048": (64, 2048, 1)}
    results = []
    for name, (num_seqs, seq_len, q_len) in cases.items():
        case = make_case(num_seqs, seq_len, q_len, gen)
        err = check(case, scale)
        if err > 2e-2:
            sys.exit(f"{name}: Triton differs from the torch reference by {err:.3g}")
        results.append({"case": name, "max_abs_err": err, **time_case(case, scale)})
        del case
        torch.cuda.empty_cache()
    if args.json:
        print(json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=2))
        return
    print(torch.cuda.get_device_name(), "bf16")
    for r in results:
        fa = r["flash_attn_varlen_ms"]
        print(f"{r['case']:<28} err {r['max_abs_err']:.2e}  triton {r['triton_ms']:.3f} ms  "
              f"sdpa {r['sdpa_contiguous_ms']:.3f} ms  flash-attn "
              f"{'n/a' if fa is None else f'{fa:.3f} ms'}")  # fmt: skip


if __name__ == "__main__":
    main()
