"""Engine surface: loading rules, input validation, streaming, asyncio, capacity, stats."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from support import ids, tiny_config

from ragkv.cache_engine import Engine, EngineConfig, SamplingParams
from ragkv.errors import (
    CacheCapacityError,
    ConfigError,
    InvalidInputError,
    ModelNotFoundError,
    PromptTooLongError,
    RagkvError,
    UnsupportedModelError,
)

# -- loading -------------------------------------------------------------------------


def write_config(tmp_path, **config) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("config", "named"),
    [
        (
            {"model_type": "mistral", "sliding_window": 256, "max_position_embeddings": 4096},
            "sliding",
        ),
        ({"model_type": "t5", "is_encoder_decoder": True}, "encoder-decoder"),
        ({"model_type": "mamba", "state_size": 16, "conv_kernel": 4}, "recurrent"),
        (
            {"model_type": "qwen3_next", "layer_types": ["linear_attention", "full_attention"]},
            "hybrid",
        ),
        ({"model_type": "gpt2"}, "not supported"),
    ],
)
def test_unsupported_architectures_fail_at_load_naming_the_feature(tmp_path, config, named):
    write_config(tmp_path, **config)
    with pytest.raises(UnsupportedModelError, match=named):
        Engine.from_pretrained(tmp_path, device="cpu")


def test_qwen2_with_sliding_window_switched_off_is_accepted(tmp_path):
    config = tiny_config("qwen2", use_sliding_window=False, sliding_window=64)
    from ragkv.cache_engine.model_support import check_supported

    check_supported(config.to_dict())


def test_missing_directory_and_missing_config_are_clear_errors(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        Engine.from_pretrained(tmp_path / "nope", device="cpu")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        Engine.from_pretrained(tmp_path, device="cpu")


def test_a_hub_id_or_a_config_only_directory_says_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError, match="looks like a Hugging Face hub id.*hf download"):
        Engine.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct", device="cpu")
    tiny_config("llama").save_pretrained(tmp_path / "config-only")
    with pytest.raises(
        ModelNotFoundError, match=r"no weights \(\*\.safetensors\) and no tokenizer"
    ):
        Engine.from_pretrained(tmp_path / "config-only", device="cpu")


def test_engine_from_a_config_matches_from_pretrained_keywords(llama_dir, engine):
    config = EngineConfig(model=llama_dir, device="cpu", kv_cache_tokens=2048, hash_algo="blake3")
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    with Engine.from_config(config) as from_config:
        assert from_config.config == config and from_config.kv_cache_tokens == 2048
        out = from_config.generate(ids(40, 30), params)
    with Engine.from_pretrained(llama_dir, device="cpu", kv_cache_tokens=2048, hash="blake3") as e:
        assert e.config == config
    assert out.token_ids == engine.generate(ids(40, 30), params).token_ids


def test_block_size_must_be_a_multiple_of_8(llama_dir):
    with pytest.raises(ConfigError, match="multiple of 8"):
        Engine.from_pretrained(llama_dir, device="cpu", block_size=12)


# -- input validation happens before anything is queued ------------------------------


@pytest.mark.parametrize(
    ("prompt", "params", "error", "match"),
    [
        ([], None, InvalidInputError, "empty"),
        ("", None, InvalidInputError, "empty"),
        ([1, 2, 512], None, InvalidInputError, "outside the vocabulary"),
        ([1, -1], None, InvalidInputError, "outside the vocabulary"),
        ([1, 2.5], None, InvalidInputError, "outside the vocabulary"),
        ([1, 2], {"max_tokens": 0}, InvalidInputError, "max_tokens"),
        ([1, 2], {"temperature": -1.0}, InvalidInputError, "temperature"),
        ([1, 2], {"top_p": 0.0}, InvalidInputError, "top_p"),
        ([5] * 2048, None, PromptTooLongError, "context"),
        ("lone \ud800 surrogate", None, InvalidInputError, "prompt"),
    ],
)
def test_bad_input_raises_before_any_work_is_queued(engine, prompt, params, error, match):
    with pytest.raises(error, match=match):
        engine.generate(prompt, None if params is None else SamplingParams(**params))
    assert engine.stats().steps == 0


@pytest.mark.parametrize(
    ("call", "param"),
    [
        (lambda e: e.generate([]), "prompt"),
        (lambda e: e.generate(""), "prompt"),
        (lambda e: e.generate("lone \ud800 surrogate"), "prompt"),
        (lambda e: e.generate([1, 512]), "prompt"),
        (lambda e: e.generate(b"bytes"), "prompt"),
        (lambda e: e.generate([5] * 2048), "prompt"),
        (lambda e: e.generate([[1, 2], [3]], [SamplingParams()]), "params"),
        (lambda e: e.generate([1, 2], {"max_tokens": 3}), "params"),
        (lambda e: e.generate([1, 2], cache_salt=7), "cache_salt"),
        (lambda e: e.generate([1, 2], cache_salt="x" * 257), "cache_salt"),
        (lambda e: e.generate([1, 2], cache_salt="lone \ud800"), "cache_salt"),
        (lambda e: e.cached_prefix_length([1, 2], cache_salt="x" * 257), "cache_salt"),
    ],
)
def test_input_errors_name_the_offending_field(engine, call, param):
    with pytest.raises(InvalidInputError) as info:
        call(engine)
    assert info.value.param == param


def test_capacity_errors_name_the_field_to_change(llama_dir):
    with Engine.from_pretrained(llama_dir, device="cpu", kv_cache_tokens=64) as small:
        with pytest.raises(PromptTooLongError) as too_long:
            small.generate(ids(0, 100))
        with pytest.raises(CacheCapacityError) as too_big:
            small.generate(ids(0, 60), SamplingParams(max_tokens=20))
    assert too_long.value.param == "prompt"
    assert too_big.value.param == "max_tokens"


def test_request_larger_than_the_pool_is_refused(llama_dir):
    with Engine.from_pretrained(llama_dir, device="cpu", kv_cache_tokens=64) as small:
        with pytest.raises(PromptTooLongError, match="whole pool"):
            small.generate(ids(0, 100))
        with pytest.raises(CacheCapacityError, match="max_tokens"):
            small.generate(ids(0, 60), SamplingParams(max_tokens=20))
        ok = small.generate(ids(0, 60), SamplingParams(max_tokens=4))
    assert ok.usage.completion_tokens >= 1


# -- outputs, streaming, async ------------------------------------------------------


def test_generate_many_returns_outputs_in_prompt_order(engine):
    prompts = [ids(i, 20 + i) for i in range(5)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))
    assert [o.prompt_token_ids for o in outs] == prompts
    assert all(o.usage.completion_tokens == 3 and o.finish_reason == "length" for o in outs)
    assert all(o.timings.ttft_s <= o.timings.total_s for o in outs)


def test_string_prompts_are_tokenized_with_the_model_tokenizer(engine):
    out = engine.generate("The quick brown fox", SamplingParams(max_tokens=2))
    expected = engine.tokenizer("The quick brown fox", add_special_tokens=False)["input_ids"]
    assert out.prompt_token_ids == expected


def test_stream_deltas_add_up_to_the_final_text(engine):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    deltas = list(engine.stream(ids(7, 30), params))
    final = deltas[-1].output
    assert final is not None and deltas[-1].finish_reason == "length"
    assert "".join(d.text for d in deltas) == final.text
    assert [t for d in deltas for t in d.token_ids] == final.token_ids
    assert final.token_ids == engine.generate(ids(7, 30), params).token_ids


def test_breaking_out_of_a_stream_aborts_and_frees_blocks(engine):
    stream = engine.stream(ids(8, 40), SamplingParams(max_tokens=200, ignore_eos=True))
    next(stream)
    stream.close()
    engine.generate(ids(9, 10), SamplingParams(max_tokens=1))  # the loop has processed the abort
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks


async def test_many_concurrent_astreams_get_their_own_tokens(engine):
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = [ids(100 + i, 25) for i in range(8)]
    expected = [o.token_ids for o in engine.generate(prompts, params)]

    async def collect(p):
        tokens = []
        async for delta in engine.astream(p, params):
            tokens.extend(delta.token_ids)
        return tokens

    got = await asyncio.gather(*(collect(p) for p in prompts))
    assert got == expected
    single = await engine.agenerate(prompts[0], params)
    assert single.token_ids == expected[0]


def test_threads_share_one_engine(engine):
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompts = [ids(200 + i, 30) for i in range(6)]
    expected = [o.token_ids for o in engine.generate(prompts, params)]
    results: dict[int, list[int]] = {}

    def worker(i: int) -> None:
        results[i] = engine.generate(prompts[i], params).token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [results[i] for i in range(6)] == expected


def test_stop_token_ids_and_logprobs(engine):
    greedy = engine.generate(ids(11, 20), SamplingParams(max_tokens=6, ignore_eos=True))
    stop_at = greedy.token_ids[2]
    out = engine.generate(
        ids(11, 20), SamplingParams(max_tokens=6, stop_token_ids=[stop_at], logprobs=2)
    )
    assert out.finish_reason == "stop"
    assert out.token_ids == greedy.token_ids[: greedy.token_ids.index(stop_at) + 1]
    assert len(out.logprobs) == len(out.token_ids)


def test_seeded_sampling_is_reproducible_across_batches(engine):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=1234, ignore_eos=True)
    alone = engine.generate(ids(12, 20), params)
    batched = engine.generate([ids(13, 33), ids(12, 20), ids(14, 5)], params)
    assert batched[1].token_ids == alone.token_ids


def test_stats_count_reused_and_computed_prefill_tokens(engine):
    p = ids(15, 64)
    engine.generate(p, SamplingParams(max_tokens=1))
    engine.generate(p, SamplingParams(max_tokens=1))
    stats = engine.stats()
    assert stats.prompt_tokens == 128
    assert stats.prefill_tokens_reused == 48
    assert stats.prefill_tokens_computed == 128 - 48
    assert stats.hit_rate == pytest.approx(48 / 128)


def test_cached_prefix_length_reports_residency_without_side_effects(engine):
    p = ids(16, 50)
    assert engine.cached_prefix_length(p) == 0
    engine.generate(p, SamplingParams(max_tokens=1))
    assert engine.cached_prefix_length(p) == 48
    assert engine.cached_prefix_length(p, cache_salt="x") == 0
    assert engine.cached_prefix_length(p[:40] + [5] * 10) == 32
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
    cache = stats.extra["cache"]
    assert (cache.queries, cache.hit_tokens) == (1, 0)  # the one admission; probes not counted


def test_closed_engine_refuses_new_requests(llama_dir):
    engine = Engine.from_pretrained(llama_dir, device="cpu", kv_cache_tokens=256)
    engine.close()
    with pytest.raises(RagkvError, match="closed"):
        engine.generate([1, 2, 3])


def test_string_prompt_ids_are_checked_against_the_model_vocabulary(engine, monkeypatch):
    vocab = engine.runner.vocab_size
    monkeypatch.setattr(engine.inputs, "tokenizer", lambda text, **kw: {"input_ids": [1, vocab]})
    with pytest.raises(InvalidInputError, match="outside the vocabulary") as info:
        engine.generate("a tokenizer with more ids than the model")
    assert info.value.param == "prompt"
    monkeypatch.setattr(engine.inputs, "tokenizer", lambda text, **kw: {"input_ids": []})
    with pytest.raises(InvalidInputError, match="no tokens") as info:
        engine.generate("   ")
    assert engine.stats().steps == 0


def test_request_ids_say_nothing_about_other_traffic(engine):
    """An id a caller sees (in an output or an error) is random, not a global counter."""
    first = engine.generate([5, 6, 7], SamplingParams(max_tokens=1)).request_id
    second = engine.generate([5, 6, 7], SamplingParams(max_tokens=1)).request_id
    assert first != second and first.startswith("req-") and len(first) == len("req-") + 16
    assert not first.removeprefix("req-").isdigit()
