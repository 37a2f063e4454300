"""KV tiers below the block pool: host memory, then disk, every load verified.

A block evicted from the KV pool can live on in host memory (:class:`HostStore`) and on disk
(:class:`DiskStore`), keyed by its chained block hash and verified on the way back against
its full hash input and a payload checksum (Invariant 7, docs/invariants.md).
:class:`KVTiers` puts the two together behind a non-blocking write queue.
"""

from ragkv.cache_engine.kv_tiers.block_store import BlockStore
from ragkv.cache_engine.kv_tiers.disk_store import DiskStore
from ragkv.cache_engine.kv_tiers.host_store import HostStore
from ragkv.cache_engine.kv_tiers.namespace import StoreNamespace, weights_fingerprint
from ragkv.cache_engine.kv_tiers.tier_stats import TierStats
from ragkv.cache_engine.kv_tiers.tiers import DEFAULT_WRITE_POLICY, WRITE_POLICIES, KVTiers

__all__ = [
    "DEFAULT_WRITE_POLICY",
    "WRITE_POLICIES",
    "BlockStore",
    "DiskStore",
    "HostStore",
    "KVTiers",
    "StoreNamespace",
    "TierStats",
    "weights_fingerprint",
]
