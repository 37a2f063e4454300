"""The KV source seam: a source written here, against the protocol alone, plugs into the
scheduler and the engine unchanged (issue 28: a third source touches neither)."""

from __future__ import annotations

import torch
from support import ids

from ragkv.cache_engine import Engine, KVCacheManager, SamplingParams
from ragkv.cache_engine.kv_source import KVMatch
from ragkv.cache_engine.request import Request, RequestStatus
from ragkv.cache_engine.scheduler import Scheduler

BLOCK = 4


class ScriptedSource:
    """Offers request "r" two blocks after the pool's prefix, once a load is 'done'."""

    def __init__(self) -> None:
        self.loaded = False
        self.calls: list[tuple] = []

    def match(self, request, num_computed):
        if request.request_id != "r":
            return None
        self.calls.append(("match", num_computed))
        if not self.loaded:
            return KVMatch(load_pending=True)
        return KVMatch(num_tokens=2 * BLOCK, handle="mine")

    def is_ready(self, request):
        return self.loaded

    def allocated(self, request, match, block_table, num_pool_blocks):
        handle = None if match is None else match.handle
        self.calls.append(("allocated", request.request_id, handle, num_pool_blocks))

    def computed(self, request):
        pass

    def release(self, request):
        self.calls.append(("release", request.request_id))

    def add_stats(self, stats):
        pass


def test_a_request_waits_for_its_sources_kv_while_others_run_then_starts_after_it():
    source = ScriptedSource()
    scheduler = Scheduler(KVCacheManager(64, BLOCK), sources=[source])
    r = Request("r", list(range(20)), SamplingParams(max_tokens=1))
    o = Request("o", list(range(100, 110)), SamplingParams(max_tokens=1))
    scheduler.add(r)
    scheduler.add(o)

    out = scheduler.schedule()
    assert [s.request.request_id for s in out.slices] == ["o"]
    assert r.status is RequestStatus.WAITING_FOR_KV and r not in scheduler.waiting
    assert scheduler.has_unfinished()
    scheduler.update(out, [7])  # o finishes (max_tokens=1)
    assert not scheduler.has_work()  # r still waits: a step now would schedule nothing

    source.loaded = True
    assert scheduler.has_work()
    out = scheduler.schedule()
    [piece] = out.slices
    assert (piece.request, piece.start, piece.num_tokens) == (r, 2 * BLOCK, 20 - 2 * BLOCK)
    assert r.num_cached_tokens == 2 * BLOCK
    assert ("allocated", "r", "mine", 0) in source.calls
    assert ("allocated", "o", None, 0) in source.calls  # every admission is told
    scheduler.update(out, [7])
    assert ("release", "r") in source.calls


class CopyStore:
    """A remote store in miniature: keeps each computed prompt's full blocks by hash and
    gives them back to later requests, through the KVSource protocol only."""

    def __init__(self, engine: Engine) -> None:
        self.kv = engine.kv
        self.caches = engine.runner.kv_caches
        self.blocks: dict[bytes, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.served = 0

    def _hashes(self, request):
        hasher = request.block_hasher
        return hasher.hashes[: (request.num_tokens - 1) // BLOCK16]

    def match(self, request, num_computed):
        hashes = self._hashes(request)
        first = num_computed // BLOCK16
        n = 0
        while first + n < len(hashes) and hashes[first + n] in self.blocks:
            n += 1
        return KVMatch(num_tokens=n * BLOCK16, handle=hashes[first : first + n]) if n else None

    def is_ready(self, request):
        return True

    def allocated(self, request, match, block_table, num_pool_blocks):
        if match is None:
            return
        for i, block_hash in enumerate(match.handle):
            block_id = block_table[num_pool_blocks + i]
            for (k_cache, v_cache), (k, v) in zip(
                self.caches, self.blocks[block_hash], strict=True
            ):
                k_cache[block_id].copy_(k)
                v_cache[block_id].copy_(v)
        self.served += len(match.handle)

    def computed(self, request):
        if request.num_computed_tokens < request.num_prompt_tokens:
            return
        table = self.kv.block_table(request)
        for i, block_hash in enumerate(self._hashes(request)):
            block_id = table[i]
            self.blocks[block_hash] = [
                (k[block_id].clone(), v[block_id].clone()) for k, v in self.caches
            ]

    def release(self, request):
        pass

    def add_stats(self, stats):
        pass


BLOCK16 = 16
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


def test_a_source_defined_outside_the_engine_serves_exact_kv(llama_dir):
    prompt = ids(0, 100)
    with Engine.from_pretrained(
        llama_dir, device="cpu", kv_cache_tokens=2048, enable_prefix_caching=False
    ) as plain:
        reference = plain.generate(prompt, GREEDY, return_logits=True)
    with Engine.from_pretrained(llama_dir, device="cpu", kv_cache_tokens=2048) as engine:
        store = CopyStore(engine)
        engine.scheduler.sources = (*engine.scheduler.sources, store)
        engine.generate(prompt, GREEDY)
        assert engine.reset_prefix_cache()  # the pool forgets: only the store has it
        out = engine.generate(prompt, GREEDY, return_logits=True)
    assert store.served == 6  # (100 - 1) // 16 blocks
    assert out.usage.cached_tokens == 96
    assert out.token_ids == reference.token_ids
    torch.testing.assert_close(out.logits, reference.logits[out.logits_start :], rtol=0, atol=1e-4)
