"""Engine benchmark lanes, side by side in one run (CPU figures are ratios, not absolutes).

1. TTFT: a 2,048-token prompt whose first 1,900 tokens are cached vs the same prompt cold,
   and cold TTFT vs a plain transformers forward of the same ids.
2. Throughput: 16 concurrent 1k-token prompts x 64 output tokens: the engine vs
   transformers ``generate`` one by one, and vs transformers' ``generate_batch``.
3. Engine overhead (everything outside the model forward) as a share of step time.

Usage: ``python benchmarks/engine_bench.py [--model PATH] [--dtype float32] [--json FILE]``
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from ragkv.cache_engine import Engine, SamplingParams, default_model_path


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


def ttft_lane(engine: Engine, hf_model, rng: random.Random, repeats: int) -> dict:
    vocab = engine.runner.vocab_size
    params = SamplingParams(max_tokens=1)
    cold, warm, plain = [], [], []
    for _ in range(repeats):
        base = random_ids(rng, 2048, vocab)
        out = engine.generate(base, params)
        assert out.usage.cached_tokens == 0
        cold.append(out.timings.ttft_s)
        variant = base[:1900] + random_ids(rng, 148, vocab)
        out = engine.generate(variant, params)
        assert out.usage.cached_tokens == 1888, out.usage
        warm.append(out.timings.ttft_s)
        with torch.inference_mode():
            t0 = time.perf_counter()
            hf_model(torch.tensor([base]), logits_to_keep=1)
            plain.append(time.perf_counter() - t0)
    cold_s, warm_s, plain_s = (statistics.median(x) for x in (cold, warm, plain))
    return {
        "cold_ttft_s": cold_s,
        "warm_ttft_s": warm_s,
        "hf_forward_s": plain_s,
        "warm_over_cold": warm_s / cold_s,
        "cold_over_hf_forward": cold_s / plain_s,
    }


def throughput_lane(
    engine: Engine, hf_model, rng: random.Random, n: int, prompt_len: int, out_len: int
) -> dict:
    vocab = engine.runner.vocab_size
    prompts = [random_ids(rng, prompt_len, vocab) for _ in range(n)]
    params = SamplingParams(max_tokens=out_len, ignore_eos=True)
    before = engine.stats()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    engine_s = time.perf_counter() - t0
    after = engine.stats()
    tokens = sum(len(o.token_ids) for o in outs)
    result = {
        "requests": n,
        "prompt_tokens": prompt_len,
        "output_tokens": out_len,
        "engine_s": engine_s,
        "engine_tokens_per_s": tokens / engine_s,
        "engine_overhead_share": 1.0
        - (after.model_s - before.model_s) / (after.step_s - before.step_s),
    }
    t0 = time.perf_counter()
    hf_tokens = 0
    with torch.inference_mode():
        for p in prompts:
            g = hf_model.generate(
                torch.tensor([p]), max_new_tokens=out_len, do_sample=False, eos_token_id=None
            )
            hf_tokens += g.shape[1] - len(p)
            if hf_tokens == out_len:
                match = g[0, len(p) :].tolist() == outs[0].token_ids
                result["first_output_matches_hf"] = match
    hf_s = time.perf_counter() - t0
    result["hf_generate_s"] = hf_s
    result["hf_generate_tokens_per_s"] = hf_tokens / hf_s
    result["engine_over_hf_generate"] = (
        result["engine_tokens_per_s"] / result["hf_generate_tokens_per_s"]
    )
    try:
        from transformers import GenerationConfig

        config = GenerationConfig(max_new_tokens=out_len, do_sample=False, eos_token_id=None)
        t0 = time.perf_counter()
        batch = hf_model.generate_batch(prompts, generation_config=config, progress_bar=False)
        cb_s = time.perf_counter() - t0
        cb_tokens = sum(len(r.generated_tokens) for r in batch.values())
        result["hf_generate_batch_tokens_per_s"] = cb_tokens / cb_s
        result["engine_over_hf_generate_batch"] = result["engine_tokens_per_s"] / (cb_tokens / cb_s)
    except Exception as exc:  # report why it could not run on this machine
        result["hf_generate_batch_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="local checkpoint (default: embedded)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--json", default=None, help="write results to this file")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    path = args.model or default_model_path()
    dtype = getattr(torch, args.dtype)
    engine = Engine.from_pretrained(path, device="cpu", dtype=dtype, kv_cache_tokens=40_000)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    rng = random.Random(0)
    engine.generate(random_ids(rng, 64, engine.runner.vocab_size), SamplingParams(max_tokens=2))
    results = {
        "machine": {
            "threads": torch.get_num_threads(),
            "dtype": args.dtype,
            "torch": torch.__version__,
        },
        "ttft": ttft_lane(engine, hf_model, rng, args.repeats),
    }
    print(json.dumps(results["ttft"], indent=2))
    if not args.skip_throughput:
        engine.reset_prefix_cache()
        results["throughput"] = throughput_lane(
            engine, hf_model, rng, args.requests, args.prompt_len, args.output_len
        )
        print(json.dumps(results["throughput"], indent=2))
    engine.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
