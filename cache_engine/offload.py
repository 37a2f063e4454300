"""The engine's side of the KV tiers: blocks out of the pool after a step, back in at admission.

The stores themselves (host memory, disk, verification) live in
:mod:`ragkv.cache_engine.kv_tiers`; this module moves K/V between them and the pool.

Write path (:meth:`KVOffload.save_written`, stepping thread, right after the forward)::

    blocks the step wrote and the pool registered  ->  one gather per layer  ->  CPU payloads
    -> KVTiers.offer (non-blocking: the store's worker keeps them)

Only blocks that the step's forward just filled *and* that the pool registered under their
hash are offered: never K/V that was not written (a failed step offers nothing, a request
discarded while scheduling is not in the batch), never an unregistered private copy, and
never approximate (non-prefix) chunk reuse, which is not registered. The gather runs in the
stepping thread before the next step can reuse a block, so no block is pinned; on CPU it is
a memory copy of ~0.7 MB per block of the default model, a few per cent of the forward that
wrote it (docs/benchmarks.md). On CUDA the gather runs on the compute stream (so it reads
the blocks before any later step can overwrite them) and the copy to pinned host memory on
a side stream; the offer carries the copy's event, which the tiers' writer waits on before
reading (this CUDA path is untested here: no GPU in CI).

Read path: a :class:`~ragkv.cache_engine.tier_source.TierSource` (one of the scheduler's KV
sources) looks a waiting request's next blocks up and asks the loader thread here to load
them (verified) into CPU staging while the request waits for K/V; once admitted, its staged
blocks are copied into fresh pool blocks (:meth:`KVOffload.install`), which the pool
registers, so later requests hit the pool.

So a step never waits for another request's loads: the slow part (reading, checksumming)
runs in the loader thread while the engine keeps stepping other requests, and the request
is scheduled only once its payloads are in memory; the copy into the pool is a memory copy
in the stepping thread. Staged payloads are bounded (at most the pool's size in blocks).

The loader thread, its staging and its deadline (a request waits at most
``load_timeout_s`` for its loads, a hung read included) are
:mod:`ragkv.cache_engine.tier_loader`'s; :meth:`KVOffload.loader_health` reports its
progress (``Engine.health().kv_loader``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ragkv.cache_engine.config import DEFAULT_KV_LOAD_TIMEOUT_S
from ragkv.cache_engine.tier_loader import StagedBlocks, TierLoader

if TYPE_CHECKING:
    from ragkv.cache_engine.config import EngineConfig
    from ragkv.cache_engine.kv_cache_manager import KVCacheManager
    from ragkv.cache_engine.model_runner import ModelRunner
    from ragkv.cache_engine.step import SchedulerOutput

logger = logging.getLogger(__name__)


def open_tiers(config: EngineConfig, runner: ModelRunner) -> Any:
    """The configured :class:`~ragkv.cache_engine.kv_tiers.KVTiers` (host and/or disk).

    The disk store is namespaced by the model identity, a fingerprint of the weights, the
    dtype, the block size, the hash algorithm and the payload layout (Invariant 7), so a
    changed checkpoint at the same path, or another engine setup, never reads old entries.
    """
    from ragkv.cache_engine.kv_tiers import HostStore, KVTiers

    pinned = runner.device.type == "cuda"
    host = (
        HostStore(config.host_cache_bytes, pin_memory=pinned) if config.host_cache_bytes else None
    )
    disk = None
    if config.kv_store_dir is not None:
        from ragkv.cache_engine.kv_tiers import DiskStore, StoreNamespace, weights_fingerprint

        namespace = StoreNamespace(
            model_identity=runner.identity.decode(),
            weights_fingerprint=weights_fingerprint(runner.path),
            dtype=str(runner.dtype).removeprefix("torch."),
            block_size=runner.block_size,
            hash_algo=config.hash_algo,
            layout=payload_layout(runner),
        )
        disk = DiskStore(config.kv_store_dir, config.kv_store_bytes, namespace)
    return KVTiers(
        host,
        disk,
        write_policy=config.kv_tier_write_policy,
        salted_to_disk=config.kv_store_salted,
    )


def payload_layout(runner: ModelRunner) -> str:
    """The payload's shape as a name: ``[layers, 2 (K, V), block_size, kv_heads, head_dim]``."""
    shape = payload_shape(runner)
    return "LKVBHD:" + "x".join(map(str, shape))


def payload_shape(runner: ModelRunner) -> tuple[int, ...]:
    return (runner.num_layers, 2, runner.block_size, runner.num_kv_heads, runner.head_dim)


@dataclass(slots=True)
class WrittenBlock:
    """A pool block the last step filled and registered: what the tiers may keep."""

    block_id: int
    block_hash: bytes
    hash_input: bytes
    salted: bool


def written_blocks(batch: SchedulerOutput, kv: KVCacheManager) -> list[WrittenBlock]:
    """Blocks that became full in this step's slices and are the pool's registered copy.

    A slice ``[start, end)`` completes blocks ``start // block_size .. end // block_size - 1``
    (those holding one of its tokens and ending by ``end``). Call after the forward ran.
    """
    out: list[WrittenBlock] = []
    block_size = kv.block_size
    for chunk in batch.slices:
        salted = chunk.request.salt_digest is not None
        for i in range(chunk.start // block_size, chunk.end // block_size):
            block_id = chunk.block_table[i]
            registered = kv.registered(block_id)
            if registered is None:
                continue  # unregistered: a private copy, or never to be shared
            out.append(WrittenBlock(block_id, *registered, salted))
    return out


@dataclass(slots=True)
class TierCounters:
    """What the engine moved between the pool and the tiers (see ``EngineStats``)."""

    hit_tokens: dict[str, int] = field(default_factory=dict)  # reused, by tier
    loaded_blocks: dict[str, int] = field(default_factory=dict)
    loaded_bytes: dict[str, int] = field(default_factory=dict)
    load_s: dict[str, float] = field(default_factory=dict)  # loader-thread seconds, by tier
    load_misses: int = 0  # lookups that promised a block the verified load did not give
    stale_loads: int = 0  # staged runs dropped: the pool lost blocks before them meanwhile
    offered_blocks: int = 0
    offered_bytes: int = 0
    save_s: float = 0.0  # stepping-thread seconds copying new blocks out of the pool
    install_s: float = 0.0  # stepping-thread seconds copying loaded blocks into the pool
    save_errors: int = 0
    load_timeouts: int = 0  # parked requests that stopped waiting for their loads
    stalled_skips: int = 0  # lookups not made because the loader was stuck in one read

    def copy(self) -> TierCounters:
        """A snapshot: the per-tier dicts copied, the plain counts as they are."""
        copied = dataclasses.replace(self)
        for name in ("hit_tokens", "loaded_blocks", "loaded_bytes", "load_s"):
            setattr(copied, name, dict(getattr(self, name)))
        return copied


class KVOffload:
    """Moves K/V between one engine's pool and its :class:`KVTiers`; owns the loader thread.

    The write path is called by the engine core after each forward; on the read path a
    :class:`~ragkv.cache_engine.tier_source.TierSource` (the scheduler's KV source) decides
    what to load and this class loads and installs it.

    ``wake`` is called (from the loader thread) when a parked request's loads are done, so
    an idle stepping thread picks it up at once.
    """

    def __init__(
        self,
        tiers: Any,
        runner: ModelRunner,
        *,
        max_staged_blocks: int,
        load_timeout_s: float = DEFAULT_KV_LOAD_TIMEOUT_S,
        wake: Callable[[], None] = lambda: None,
    ) -> None:
        self.tiers = tiers
        self.kv_caches = runner.kv_caches
        self.device = runner.device
        self.dtype = runner.dtype
        self.block_size = runner.block_size
        self.shape = payload_shape(runner)
        self.block_bytes = runner.bytes_per_block()
        self.counters = TierCounters()
        self.lock = threading.Lock()  # guards the counters (the loader counts under it too)
        self.loader = TierLoader(
            tiers,
            shape=self.shape,
            dtype=self.dtype,
            block_bytes=self.block_bytes,
            max_staged_blocks=max_staged_blocks,
            load_timeout_s=load_timeout_s,
            counters=self.counters,
            lock=self.lock,
            wake=wake,
        )
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    # -- write path (stepping thread) ----------------------------------------------------
    def save_written(self, blocks: Sequence[WrittenBlock]) -> None:
        """Copy ``blocks`` out of the pool and offer them to the tiers; never raises."""
        started = time.perf_counter()
        try:
            if blocks:
                self._save(blocks)
        except Exception:  # the tiers are a cache: a failed save costs hits, not requests
            logger.exception("could not offer %d blocks to the KV tiers", len(blocks))
            with self.lock:
                self.counters.save_errors += 1
        with self.lock:
            self.counters.save_s += time.perf_counter() - started

    def _save(self, blocks: Sequence[WrittenBlock]) -> None:
        ids = torch.tensor([b.block_id for b in blocks], dtype=torch.long, device=self.device)
        if self._copy_stream is None:
            payloads = self._gather(ids, torch.device("cpu"))
            self._offer(blocks, payloads)
            return
        staged = self._gather(ids, self.device)  # on the compute stream: before any reuse
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            host = torch.empty(staged.shape, dtype=self.dtype, pin_memory=True)
            host.copy_(staged, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        staged.record_stream(stream)
        self._offer(blocks, host, ready=done)

    def _gather(self, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``[n, layers, 2, block_size, kv_heads, head_dim]``: one gather per layer and K/V."""
        out = torch.empty((len(ids), *self.shape), dtype=self.dtype, device=device)
        for layer, (k_cache, v_cache) in enumerate(self.kv_caches):
            out[:, layer, 0] = k_cache.index_select(0, ids)
            out[:, layer, 1] = v_cache.index_select(0, ids)
        return out

    def _offer(
        self, blocks: Sequence[WrittenBlock], payloads: torch.Tensor, ready: Any = None
    ) -> None:
        extra = {} if ready is None else {"ready": ready}  # CUDA: the writer waits on it
        for block, payload in zip(blocks, payloads, strict=True):
            self.tiers.offer(
                block.block_hash, block.hash_input, payload, salted=block.salted, **extra
            )
        with self.lock:
            self.counters.offered_blocks += len(blocks)
            self.counters.offered_bytes += len(blocks) * self.block_bytes

    # -- read path: staged payloads into the pool (a TierSource decides; stepping thread) --
    def install(self, staged: StagedBlocks, block_ids: Sequence[int]) -> None:
        """Copy ``staged`` into pool blocks ``block_ids`` (every layer) and count the hits."""
        started = time.perf_counter()
        payload = torch.stack(staged.payloads)
        if self.device.type == "cuda":
            payload = payload.to(self.device, non_blocking=True)
        ids = torch.tensor(list(block_ids[: len(staged)]), dtype=torch.long, device=self.device)
        for layer, (k_cache, v_cache) in enumerate(self.kv_caches):
            k_cache.index_copy_(0, ids, payload[:, layer, 0])
            v_cache.index_copy_(0, ids, payload[:, layer, 1])
        with self.lock:
            counters = self.counters
            for tier, tokens in staged.tokens_by_tier(self.block_size).items():
                counters.hit_tokens[tier] = counters.hit_tokens.get(tier, 0) + tokens
            counters.install_s += time.perf_counter() - started

    def loader_health(self) -> dict[str, Any]:
        """The loader's progress (:meth:`TierLoader.health`)."""
        return self.loader.health()

    # -- lifetime --------------------------------------------------------------------------
    def stats(self) -> tuple[TierCounters, dict[str, Any]]:
        """The engine's tier counters, and the stores' own (``KVTiers.stats``)."""
        with self.lock:
            counters = self.counters.copy()
        try:
            stores = dict(self.tiers.stats())
        except Exception:
            logger.exception("KV tier stats failed")
            stores = {}
        return counters, stores

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait for the tiers to store what they were offered."""
        self.tiers.flush(timeout_s=timeout_s)

    def resident_blocks(self, hashes: Sequence[bytes], first_block: int) -> int:
        """How many blocks from ``first_block`` on the tiers hold (unverified, cheap)."""
        if first_block >= len(hashes):
            return 0
        try:
            return len(self.tiers.lookup(list(hashes[first_block:])))
        except Exception:
            logger.exception("KV tier lookup failed")
            return 0

    def close(self) -> None:
        """Stop the loader, flush the tiers (so a store directory keeps every block), close."""
        self.loader.close()
        try:
            self.flush()
        finally:
            self.tiers.close()
