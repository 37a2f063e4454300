"""KV tiers in the engine, with the real host and disk stores (Invariant 7).

Logits and greedy tokens are the same whether a prefix came from the pool, host memory or
disk, and after a restart; a damaged, foreign or missing store costs hits, never exactness
or a request. Every family runs the pool -> host -> disk -> restart path on a tiny model.
"""

from __future__ import annotations

import pytest
import torch
from support import FAMILIES, ids, save_tiny_checkpoint

from ragkv.cache_engine import Engine, SamplingParams

BLOCK = 16
N = 100  # prompt tokens: 6 full blocks reusable, 7 pool blocks with the output
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)
# The tiny models' payload: 2 layers x (K, V) x 16 tokens x 2 KV heads x 16 dims x fp32.
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4
HOST_16_BLOCKS = 16 * (BLOCK_BYTES + 256)  # an entry also counts its hash input


def tiered(path, **kwargs) -> Engine:
    """A 7-block pool: each 100-token request evicts the previous one's blocks."""
    kwargs.setdefault("kv_cache_tokens", 7 * BLOCK)
    return Engine.from_pretrained(path, device="cpu", **kwargs)


def flushed(engine: Engine) -> Engine:
    """Wait for the tiers' writer, so the next lookup sees every block offered so far."""
    engine.core.offload.flush()
    return engine


def references(path, seeds, salt=None) -> dict[int, object]:
    with Engine.from_pretrained(
        path, device="cpu", kv_cache_tokens=2048, enable_prefix_caching=False
    ) as eng:
        return {s: eng.generate(ids(s, N), GREEDY, return_logits=True) for s in seeds}


def assert_exact(out, ref) -> None:
    assert out.token_ids == ref.token_ids
    start = out.logits_start
    assert out.logits.shape[0] == ref.logits.shape[0] - start
    torch.testing.assert_close(out.logits, ref.logits[start:], rtol=0, atol=1e-4)


def assert_accounted(out) -> None:
    """cached_tokens is every reused token, and the breakdown adds up to it."""
    assert sum(out.usage.cached_tokens_by_tier.values()) == out.usage.cached_tokens


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=5)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("llama-tiers"), "llama", seed=7)
    return path, references(path, range(5))


def run_and_close(path, store, seeds, **kwargs) -> list:
    with tiered(path, kv_store_dir=store, **kwargs) as eng:
        return [eng.generate(ids(s, N), GREEDY, return_logits=True) for s in seeds]


def assert_recomputed_exactly(path, store, ref) -> None:
    """A new engine over ``store`` reuses nothing of prompt 0 and answers it exactly."""
    (out,) = run_and_close(path, store, [0])
    assert out.usage.cached_tokens == 0
    assert_exact(out, ref)


def test_a_prefix_from_the_pool_or_host_memory_is_exact(family_dir):
    refs = references(family_dir, range(2))
    with tiered(family_dir, host_cache_bytes=HOST_16_BLOCKS) as eng:
        cold = eng.generate(ids(0, N), GREEDY, return_logits=True)
        pool = eng.generate(ids(0, N), GREEDY, return_logits=True)
        other = flushed(eng).generate(ids(1, N), GREEDY, return_logits=True)
        host = flushed(eng).generate(ids(0, N), GREEDY, return_logits=True)
    assert [o.usage.cached_tokens_by_tier for o in (cold, pool, host)] == [
        {"pool": 0},
        {"pool": 96},
        {"pool": 0, "host": 96},
    ]
    for out, ref in ((cold, refs[0]), (pool, refs[0]), (other, refs[1]), (host, refs[0])):
        assert_exact(out, ref)


def test_a_prefix_from_pool_host_disk_and_after_a_restart_is_exact(family_dir, tmp_path):
    refs = references(family_dir, range(4))
    store = tmp_path / "store"
    seen: dict[str, int] = {}
    with tiered(family_dir, host_cache_bytes=HOST_16_BLOCKS, kv_store_dir=store) as eng:
        outs = [eng.generate(ids(0, N), GREEDY, return_logits=True)]
        outs.append(eng.generate(ids(0, N), GREEDY, return_logits=True))  # the pool
        eng.generate(ids(1, N), GREEDY)  # prompt 0 leaves the pool for host memory
        outs.append(flushed(eng).generate(ids(0, N), GREEDY, return_logits=True))  # host
        for s in (1, 2, 3):  # host holds 16 blocks: prompt 0 (least recent) goes to disk
            flushed(eng).generate(ids(s, N), GREEDY)
        outs.append(flushed(eng).generate(ids(0, N), GREEDY, return_logits=True))  # disk
        stats = eng.stats()
    with tiered(family_dir, host_cache_bytes=HOST_16_BLOCKS, kv_store_dir=store) as eng:
        outs.append(eng.generate(ids(0, N), GREEDY, return_logits=True))  # restarted: disk
    for out in outs:
        assert_exact(out, refs[0])
        assert_accounted(out)
        for tier, tokens in out.usage.cached_tokens_by_tier.items():
            seen[tier] = seen.get(tier, 0) + tokens
    by_tier = [out.usage.cached_tokens_by_tier for out in outs]
    assert by_tier[0] == {"pool": 0}
    assert by_tier[1] == {"pool": 96}
    assert by_tier[2] == {"pool": 0, "host": 96}
    assert by_tier[3] == {"pool": 0, "disk": 96}
    assert by_tier[4] == {"pool": 0, "disk": 96}
    assert stats.prefill_tokens_reused == sum(stats.tier_hit_tokens.values())
    assert stats.tier_loaded_blocks["host"] >= 6 and stats.tier_loaded_blocks["disk"] == 6


def test_a_new_engine_on_the_store_serves_the_prefix_from_disk_at_once(llama, tmp_path):
    path, refs = llama
    run_and_close(path, tmp_path / "s", [0])
    with tiered(path, kv_store_dir=tmp_path / "s") as eng:
        out = eng.generate(ids(0, N), GREEDY, return_logits=True)
        stats = eng.stats()
    assert out.usage.cached_tokens_by_tier == {"pool": 0, "disk": 96}
    assert_exact(out, refs[0])
    assert stats.tier_hit_tokens["disk"] == 96 and stats.tier_loaded_bytes["disk"] > 0
    assert stats.tier_load_latency_s("disk") > 0
    assert stats.tiers["disk"].hits == 6


def _block_files(store):
    """Files that hold blocks: everything in the store larger than one block payload."""
    files = [p for p in store.rglob("*") if p.is_file() and p.stat().st_size >= BLOCK_BYTES]
    assert files, "the store wrote no block files"
    return files


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_store_costs_hits_never_exactness(llama, tmp_path, damage):
    path, refs = llama
    store = tmp_path / "s"
    run_and_close(path, store, [0, 1])
    for file in _block_files(store):
        if damage == "flip":
            data = bytearray(file.read_bytes())
            data[len(data) // 2] ^= 0x01
            file.write_bytes(bytes(data))
        elif damage == "truncate":
            file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
        else:
            file.unlink()
    with tiered(path, kv_store_dir=store) as eng:
        outs = [eng.generate(ids(s, N), GREEDY, return_logits=True) for s in (0, 1)]
        stats = eng.stats()
    for s, out in zip((0, 1), outs, strict=True):
        assert out.usage.cached_tokens == 0
        assert_exact(out, refs[s])
    if damage != "delete":  # the store promised blocks whose verified load failed
        assert stats.tier_load_misses >= 1
        assert stats.tiers["disk"].misses >= 1


def test_damaging_every_file_of_the_store_still_serves_exactly(llama, tmp_path):
    path, refs = llama
    store = tmp_path / "s"
    run_and_close(path, store, [0])
    for file in (p for p in store.rglob("*") if p.is_file()):
        data = bytearray(file.read_bytes())
        if data:
            data[0] ^= 0xFF
            file.write_bytes(bytes(data))
    assert_recomputed_exactly(path, store, refs[0])


def test_another_salt_never_hits_and_unsalted_blocks_can_stay_off_disk(llama, tmp_path):
    path, _ = llama
    store = tmp_path / "s"
    with tiered(path, kv_store_dir=store) as eng:
        eng.generate(ids(0, N), GREEDY, cache_salt="tenant-a")
    with tiered(path, kv_store_dir=store) as eng:
        other = eng.generate(ids(0, N), GREEDY, cache_salt="tenant-b")
    with tiered(path, kv_store_dir=store) as eng:
        same = eng.generate(ids(0, N), GREEDY, cache_salt="tenant-a")
    assert other.usage.cached_tokens == 0
    assert same.usage.cached_tokens_by_tier == {"pool": 0, "disk": 96}  # the test can fail
    # kv_store_salted=False: a salted request's blocks never reach the disk tier.
    private = tmp_path / "private"
    with tiered(path, kv_store_dir=private, kv_store_salted=False) as eng:
        eng.generate(ids(0, N), GREEDY, cache_salt="tenant-a")
        eng.generate(ids(1, N), GREEDY)
    with tiered(path, kv_store_dir=private, kv_store_salted=False) as eng:
        salted = eng.generate(ids(0, N), GREEDY, cache_salt="tenant-a")
        plain = eng.generate(ids(1, N), GREEDY)
    assert salted.usage.cached_tokens == 0
    assert plain.usage.cached_tokens_by_tier == {"pool": 0, "disk": 96}


def test_a_changed_checkpoint_at_the_same_path_never_reads_old_entries(tmp_path):
    from transformers import AutoModelForCausalLM

    path = save_tiny_checkpoint(tmp_path / "model", "llama", seed=11)
    store = tmp_path / "s"
    run_and_close(path, store, [0])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight[0, 0] += 0.5  # one weight
    model.save_pretrained(path)
    refs = references(path, [0])
    assert_recomputed_exactly(path, store, refs[0])


def test_a_full_store_keeps_within_its_bytes_and_only_loses_hits(llama, tmp_path):
    path, refs = llama
    store = tmp_path / "s"
    capacity = 3 * (BLOCK_BYTES + 4096)  # room for about three blocks with their headers
    with tiered(
        path, kv_store_dir=store, kv_store_bytes=capacity, host_cache_bytes=HOST_16_BLOCKS
    ) as eng:
        outs = [eng.generate(ids(s, N), GREEDY, return_logits=True) for s in (0, 1, 2, 3, 0)]
        flushed(eng)
        stats = eng.stats()
    for s, out in zip((0, 1, 2, 3, 0), outs, strict=True):
        assert_exact(out, refs[s])
        assert_accounted(out)
    assert stats.tiers["disk"].bytes_used <= capacity
    assert stats.tiers["host"].bytes_used <= HOST_16_BLOCKS
    on_disk = sum(p.stat().st_size for p in store.rglob("*") if p.is_file())
    assert on_disk <= capacity + 64 * 1024  # the namespace / index files are small


def test_usage_names_each_tier_in_the_openai_shape(llama, tmp_path):
    path, _ = llama
    with tiered(path, host_cache_bytes=HOST_16_BLOCKS) as eng:
        eng.generate(ids(0, N), GREEDY)
        flushed(eng).generate(ids(1, N), GREEDY)
        out = flushed(eng).generate(ids(0, N), GREEDY)
    details = out.usage.to_openai()["prompt_tokens_details"]
    assert details == {"cached_tokens": 96, "cached_tokens_by_tier": {"pool": 0, "host": 96}}
