"""Per-request block tables over a :class:`BlockPool`, with automatic prefix caching.

Protocol, as the scheduler drives it (vLLM v1 style)::

    blocks, num_computed = manager.get_computed_blocks(req)      # no references taken
    new = manager.allocate_slots(req, num_new_tokens, blocks)    # None: pool full, nothing changed
    ... engine writes K/V of tokens [num_computed, num_computed + num_new_tokens) ...
    new = manager.allocate_slots(req, 1)                         # each decode step
    manager.free(req)                                            # finished or preempted

Every block that becomes full of known tokens is registered at allocate time, so a request
scheduled later in the same step may hit it (the engine writes all K/V of a layer before
attention reads it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ragkv.cache_engine.block_events import BlockEvents
from ragkv.cache_engine.block_hash import (
    APPROXIMATE_LABEL,
    BlockHasher,
    HashFn,
    approximate_keys,
    encode_extra_keys,
    resolve_algo,
    root_hash,
)
from ragkv.cache_engine.block_pool import BlockPool
from ragkv.cache_engine.cache_stats import CacheStats
from ragkv.cache_engine.config import DEFAULTS
from ragkv.cache_engine.kv_events import AllBlocksCleared, BlockRemoved, KVEvent, wire_hash
from ragkv.errors import ConfigError


class CacheRequest(Protocol):
    """What the manager reads from a request."""

    @property
    def request_id(self) -> Hashable: ...  # read-only here, so that a str id conforms

    token_ids: list[int]  # prompt + generated so far; grows
    num_prompt_tokens: int
    salt_digest: bytes | None  # block_hash.digest_salt(cache_salt), computed by the caller
    # Its block hashes (new_hasher), kept on the request across preemption; None or absent
    # (a request type without the attribute also works), the manager makes them (and keeps
    # them on the request when it can).
    block_hasher: BlockHasher | None


@dataclass(slots=True)
class _RequestState:
    hasher: BlockHasher
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_blocks: int = 0  # leading full blocks already registered (or skipped)
    cacheable: bool = True  # False after a collision: later hashes chain off a shared key
    cache_limit: int | None = None  # tokens past this hold approximate K/V: not exact
    approximate_scope: bytes | None = None  # blocks past cache_limit are keyed so (None: never)
    demanded: list[tuple[int, int]] = field(default_factory=list)  # (block, generation) queued


class KVCacheManager:
    """Block tables and prefix caching for every running request of one engine."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        algo: str | HashFn = DEFAULTS.hash_algo,
        extra_keys: Sequence[tuple[str, bytes]] = (),
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ConfigError(
                f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}"
            )
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_caching)
        self._algo = algo
        self._one = resolve_algo(algo)  # approximate keys (stepping thread)
        self._extra = encode_extra_keys(extra_keys)
        self._root = root_hash(algo)  # a first block's parent in its hash input
        self._events = BlockEvents(block_size, self._root, self._extra)
        self._requests: dict[Hashable, _RequestState] = {}
        self._stats = CacheStats(num_blocks=num_blocks)
        self._sink: Callable[[KVEvent], None] | None = None

    @property
    def num_blocks(self) -> int:
        """Blocks in the whole pool."""
        return self.pool.num_blocks

    @property
    def num_evictions(self) -> int:
        """Cached blocks whose hash was dropped to hand them out again."""
        return self.pool.num_evictions

    @property
    def generations(self) -> list[int]:
        """Per block, bumped whenever its K/V may change (the live list: do not mutate)."""
        return self.pool.generation

    def set_event_sink(self, sink: Callable[[KVEvent], None] | None) -> None:
        """Call ``sink`` with a KV event (:mod:`~ragkv.cache_engine.kv_events`) for every
        block the prefix cache registers (``BlockStored``) or drops (``BlockRemoved``), and
        on a reset (``AllBlocksCleared``); None stops. ``sink`` runs on the stepping thread,
        so it must not block (``KVEventBuffer.put``). Call it on the stepping thread, or
        with the engine's lock held."""
        self._sink = sink
        self.pool.removed = [] if sink is not None else None

    def snapshot_events(self) -> list[KVEvent]:
        """What a new event consumer needs to know the prefix cache as it is now:
        ``AllBlocksCleared``, then one ``BlockStored`` per cached block a prefix can reach,
        parents first (:meth:`BlockEvents.snapshot`). Call it on the stepping thread, or
        with the engine's lock held."""
        return self._events.snapshot(self.pool)

    def stored_events(self, blocks: Sequence[tuple[bytes, bytes]], medium: str) -> list[KVEvent]:
        """One ``BlockStored`` in ``medium`` per ``(hash, hash input)`` of an exact block (a
        KV tier's entries), parents before their children among them. Reads only what never
        changes after construction: any thread may call it (a tier's worker does)."""
        return self._events.stored(blocks, medium)

    def pin(self, block_ids: list[int]) -> None:
        """Take a reference on blocks a request reads but does not own (a KV source's plan)."""
        self.pool.touch(block_ids)

    def unpin(self, block_ids: list[int]) -> None:
        """Drop the references :meth:`pin` took."""
        self.pool.free(block_ids)

    def registered(self, block_id: int) -> tuple[bytes, bytes] | None:
        """``(hash, hash input)`` when the block is the prefix cache's copy of its exact hash,
        else None (unregistered, a private copy of one registered elsewhere, or approximate)."""
        pool = self.pool
        block_hash = pool.block_hash[block_id]
        if block_hash is None or pool.cached.get(block_hash) != block_id:
            return None
        hash_input = pool.hash_input[block_id]
        assert hash_input is not None  # set with the hash
        if hash_input.startswith(APPROXIMATE_LABEL):
            return None  # approximate K/V: for this pool's blend-mode requests only
        return block_hash, hash_input

    @property
    def num_free_blocks(self) -> int:
        """Blocks ``allocate_slots`` can still hand out (cached-but-free ones included)."""
        return self.pool.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens (compare with ``pool.num_blocks`` up front)."""
        return -(-num_tokens // self.block_size)

    def new_hasher(self, salt_digest: bytes | None) -> BlockHasher:
        """A block hasher with this manager's block size, extra keys and algorithm, for a
        request's ``block_hasher``. Reads only settings fixed at construction, so any
        thread may call it (the caller's, to hash a prompt before it is queued)."""
        return BlockHasher(
            self.block_size, extra=self._extra, salt_digest=salt_digest, algo=self._algo
        )

    def cached_prefix(self, hasher: BlockHasher, num_tokens: int) -> int:
        """Blocks of a token sequence's prefix the pool holds now (``hasher`` has hashed
        its ``num_tokens`` tokens; the last token is never counted as reusable)."""
        if not self.enable_caching:
            return 0
        max_blocks = (num_tokens - 1) // self.block_size
        return len(self.pool.find_prefix(hasher.hashes[:max_blocks], hasher.inputs))

    def get_computed_blocks(
        self, request: CacheRequest, *, record: bool = True
    ) -> tuple[list[int], int]:
        """Longest verified cached prefix: ``(block_ids, num_computed_tokens)``.

        At most ``len(token_ids) - 1`` tokens are reused (for a new request, its prompt), so
        the last token is always computed and yields logits. Takes no references.
        ``record=False`` leaves the query/hit counters alone (probes, ranking, or a lookup
        whose admission may still fail; see :meth:`record_lookup`).
        """
        if not self.enable_caching:
            return [], 0
        hasher = self._state(request).hasher
        token_ids = request.token_ids
        _catch_up(hasher, token_ids)
        max_blocks = (len(token_ids) - 1) // self.block_size
        block_ids = self.pool.find_prefix(hasher.hashes[:max_blocks], hasher.inputs)
        if record:
            self.record_lookup(len(token_ids), len(block_ids))
        return block_ids, len(block_ids) * self.block_size

    def note_demand(self, request: CacheRequest) -> None:
        """A queued request will reuse its cached prefix: those blocks are evicted only when
        no other free block is left, until it is admitted or leaves (:meth:`free`).

        Without it a queued request's prefix ages from its last use, and requests scheduled
        ahead of it evict the blocks it was routed (or assembled) to reuse. Takes no
        references: a demanded block is still handed out when nothing else is free."""
        block_ids, _ = self.get_computed_blocks(request, record=False)
        state = self._state(request)
        self._drop_demand(state)  # a request queued again (preempted) demands anew
        if block_ids:
            generation = self.pool.generation
            state.demanded = [(b, generation[b]) for b in block_ids]
            self.pool.add_demand(reversed(block_ids))  # as ``free`` orders them: tail first

    def reusable_hashes(self, request: CacheRequest) -> tuple[list[bytes], list[bytes]]:
        """``(hashes, inputs)`` of the request's blocks a prefix may reuse (Invariant 4 cap).

        What a lower tier is asked for past the pool's prefix; the lists are the hasher's own
        (do not mutate).
        """
        hasher = self._state(request).hasher
        _catch_up(hasher, request.token_ids)
        max_blocks = (len(request.token_ids) - 1) // self.block_size
        return hasher.hashes[:max_blocks], hasher.inputs[:max_blocks]

    def approximate_prefix(
        self, request: CacheRequest, first_block: int, scope: bytes
    ) -> list[int]:
        """Blocks ``first_block ..`` of the request's prompt the pool holds as approximate K/V
        made under ``scope`` (see :meth:`limit_caching`), up to the reuse cap. Only a
        request that accepts approximate K/V may ask; an exact lookup never finds these."""
        if not self.enable_caching:
            return []
        _, inputs = self.reusable_hashes(request)
        if first_block >= len(inputs):
            return []
        hashes, keyed = approximate_keys(inputs[first_block:], scope, self._one)
        return self.pool.find_prefix(hashes, keyed)

    def record_lookup(self, num_tokens: int, num_hit_blocks: int) -> None:
        """Count one prefix lookup of ``num_tokens`` tokens that reused ``num_hit_blocks``."""
        stats = self._stats
        stats.queries += 1
        stats.query_tokens += num_tokens
        stats.hit_tokens += num_hit_blocks * self.block_size
        stats.hit_blocks += num_hit_blocks

    def allocate_slots(
        self,
        request: CacheRequest,
        num_new_tokens: int,
        computed_blocks: list[int] | None = None,
        *,
        spare_demanded: bool = False,
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens; return the newly allocated block ids.

        ``computed_blocks`` (from :meth:`get_computed_blocks`, first call only) are touched.
        Returns None, changing nothing, when the pool cannot hold the tokens, or, with
        ``spare_demanded``, when it cannot hold them without blocks queued requests demand.
        """
        state = self._state(request)
        computed = computed_blocks if computed_blocks and not state.block_ids else []
        num_computed = len(computed) * self.block_size if computed else state.num_computed_tokens
        num_total = num_computed + num_new_tokens
        num_new_blocks = max(
            0, self.blocks_needed(num_total) - len(state.block_ids) - len(computed)
        )
        # Touching free computed blocks takes them out of the queue allocate pops from.
        if num_new_blocks + self.pool.num_free_among(computed) > self.pool.num_free_blocks:
            return None
        if spare_demanded and num_new_blocks > self.pool.num_spare_blocks(computed):
            return None
        if computed:
            self.pool.touch(computed)
            state.block_ids.extend(computed)
            state.num_cached_blocks = len(computed)
        new_block_ids = self.pool.allocate(num_new_blocks)
        assert new_block_ids is not None  # the free count was checked above
        if self.pool.removed:  # evicted to make room: said before anything is stored
            self._emit_removed()
        state.block_ids.extend(new_block_ids)
        state.num_computed_tokens = num_total
        if state.demanded:  # admitted: its prefix is referenced now
            self._drop_demand(state)
        self._cache_full_blocks(request, state, min(num_total, len(request.token_ids)))
        return new_block_ids

    def free(self, request: CacheRequest) -> None:
        """Release the request's blocks, tail first, so its least shareable blocks go first."""
        state = self._requests.pop(request.request_id, None)
        if state is not None:
            self._drop_demand(state)
            self.pool.free(reversed(state.block_ids))

    def discard(self, request: CacheRequest, num_written_tokens: int) -> None:
        """Free a request that failed mid-step, forgetting blocks whose K/V were never written.

        Blocks from ``num_written_tokens // block_size`` on may have been registered at
        allocation; those no other request holds lose their hash instead of staying findable.
        """
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return
        self._drop_demand(state)
        unwritten = state.block_ids[num_written_tokens // self.block_size :]
        self.pool.free(reversed(state.block_ids))
        for block_id in unwritten:
            if not self.pool.ref_counts[block_id]:
                self.pool.forget(block_id)
        if self.pool.removed:
            self._emit_removed()

    def limit_caching(
        self, request: CacheRequest, num_tokens: int | None, scope: bytes | None = None
    ) -> None:
        """The request's K/V past its first ``num_tokens`` tokens is approximate (chunk
        reuse): its blocks from there are never registered under their exact keys. With a
        ``scope`` they are registered under approximate keys of that scope instead, which
        only :meth:`approximate_prefix` finds. ``num_tokens=None`` lifts the limit."""
        state = self._state(request)
        state.cache_limit = num_tokens
        state.approximate_scope = scope if num_tokens is not None else None

    def block_table(self, request: CacheRequest) -> list[int]:
        """The request's block ids in token order (the live list: do not mutate)."""
        state = self._requests.get(request.request_id)
        return state.block_ids if state is not None else []

    def num_computed_tokens(self, request: CacheRequest) -> int:
        """Tokens whose K/V exist once the last allocated step has run."""
        state = self._requests.get(request.request_id)
        return state.num_computed_tokens if state is not None else 0

    def slot_mapping(self, request: CacheRequest, start: int, end: int) -> list[int]:
        """KV slots (``block_id * block_size + offset``) of token positions ``[start, end)``."""
        return slot_mapping(self.block_table(request), self.block_size, start, end)

    def stats(self) -> CacheStats:
        """A copy of the counters with the pool's current occupancy."""
        pool, s = self.pool, self._stats
        return CacheStats(
            queries=s.queries,
            query_tokens=s.query_tokens,
            hit_tokens=s.hit_tokens,
            hit_blocks=s.hit_blocks,
            evictions=pool.num_evictions,
            collisions=pool.num_collisions,
            num_blocks=pool.num_blocks,
            num_free_blocks=pool.num_free_blocks,
            usage=1.0 - pool.num_free_blocks / pool.num_blocks,
        )

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; False (nothing dropped) while any request holds blocks."""
        if not self.pool.reset():
            return False
        if self._sink is not None:
            self._sink(AllBlocksCleared())
        return True

    def _state(self, request: CacheRequest) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            hasher = getattr(request, "block_hasher", None)
            if hasher is None or hasher.block_size != self.block_size:  # made here, kept
                hasher = self.new_hasher(request.salt_digest)
                with contextlib.suppress(AttributeError):  # a request type without the slot
                    request.block_hasher = hasher
            state = self._requests[request.request_id] = _RequestState(hasher)
        return state

    def _drop_demand(self, state: _RequestState) -> None:
        """Withdraw the request's demand on blocks that still hold what it demanded."""
        if state.demanded:
            blocks, generations = zip(*state.demanded, strict=True)
            self.pool.drop_demand(blocks, generations)
            state.demanded = []

    def _cache_full_blocks(
        self, request: CacheRequest, state: _RequestState, num_known: int
    ) -> None:
        num_full = num_known // self.block_size
        if not self.enable_caching or not state.cacheable or num_full <= state.num_cached_blocks:
            return
        hasher = state.hasher
        _catch_up(hasher, request.token_ids)
        pool, first = self.pool, state.num_cached_blocks
        num_exact = num_full
        if state.cache_limit is not None:
            num_exact = min(num_full, state.cache_limit // self.block_size)
        # With a sink: the exact blocks this call registers under a new key (not a private
        # copy of a block another request registered first). Approximate ones are not told.
        new = (
            []
            if self._sink is None
            else [h not in pool.cached for h in hasher.hashes[first:num_exact]]
        )
        for i in range(first, num_exact):
            if not pool.cache(state.block_ids[i], hasher.hashes[i], hasher.inputs[i]):
                state.cacheable = False
                del new[i - first :]
                break
        else:
            self._cache_approximate(state, max(num_exact, first), num_full)
        state.num_cached_blocks = num_full
        if any(new):
            assert self._sink is not None
            for event in self._events.registered(
                request.token_ids, request.salt_digest, hasher.hashes, first, new
            ):
                self._sink(event)

    def _cache_approximate(self, state: _RequestState, first: int, num_full: int) -> None:
        """Register blocks ``first .. num_full - 1`` (approximate K/V) under approximate keys
        of the request's scope, if it has one."""
        if state.approximate_scope is None or first >= num_full:
            return
        hasher = state.hasher
        hashes, keyed = approximate_keys(
            hasher.inputs[first:num_full], state.approximate_scope, self._one
        )
        for offset, (key, data) in enumerate(zip(hashes, keyed, strict=True)):
            if not self.pool.cache(state.block_ids[first + offset], key, data):
                break  # a collision: later approximate blocks stay private

    def _emit_removed(self) -> None:
        removed = self.pool.removed
        assert self._sink is not None and removed is not None
        self._sink(BlockRemoved([wire_hash(h) for h in removed]))
        removed.clear()


def slot_mapping(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
    """KV slots (``block_id * block_size + offset``) of positions ``[start, end)`` of a table."""
    slots: list[int] = []
    pos = start
    while pos < end:
        stop = min(end, (pos // block_size + 1) * block_size)
        base = block_table[pos // block_size] * block_size - pos // block_size * block_size
        slots.extend(range(base + pos, base + stop))
        pos = stop
    return slots


def _catch_up(hasher: BlockHasher, token_ids: list[int]) -> None:
    """Feed the hasher the tokens it has not seen (no list copy on the first call)."""
    if hasher.num_tokens < len(token_ids):
        hasher.extend(token_ids[hasher.num_tokens :] if hasher.num_tokens else token_ids)
