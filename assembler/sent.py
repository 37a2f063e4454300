"""The assembler's own record of what it sent: a model-free stand-in for engine residency.

When no engine can be asked which prefix it holds (a remote server, a benchmark without a
model), the assembler remembers the full blocks of the prompts it handed out, named by
chained hashes like the engine's (parent digest, then the block's token ids), in a bounded
LRU set. ``cached_prefix_length`` then says how many leading tokens of a candidate prompt
an unbounded-enough prefix cache would already hold. It is an estimate: it does not see
evictions in the real cache, nor other clients of the same cache.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence

import xxhash

from ragkv.defaults import DEFAULT_BLOCK_SIZE
from ragkv.errors import ConfigError

_ROOT = xxhash.xxh3_128_digest(b"ragkv/assembler/sent/v1")


class SentPrefixes:
    """Chained hashes of the full blocks of recently sent prompts (at most ``max_blocks``)."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, max_blocks: int = 65_536) -> None:
        if block_size < 1 or max_blocks < 1:
            raise ConfigError("block_size and max_blocks must be >= 1.")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def cached_prefix_length(self, token_ids: Sequence[int]) -> int:
        """Leading tokens of ``token_ids`` in recorded blocks (at most ``len - 1``, as the
        engine always recomputes the last prompt token)."""
        found = 0
        for digest in self._chain(token_ids, (len(token_ids) - 1) // self.block_size):
            if digest not in self._blocks:
                break
            found += 1
        return found * self.block_size

    def record(self, token_ids: Sequence[int]) -> None:
        """Remember the full blocks of a prompt that was sent."""
        blocks = self._blocks
        for digest in self._chain(token_ids, len(token_ids) // self.block_size):
            blocks[digest] = None
            blocks.move_to_end(digest)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def __len__(self) -> int:
        return len(self._blocks)

    def _chain(self, token_ids: Sequence[int], num_blocks: int) -> list[bytes]:
        bs = self.block_size
        packed = array("i", token_ids[: num_blocks * bs]).tobytes()
        width = 4 * bs
        digests, parent = [], _ROOT
        for i in range(num_blocks):
            parent = xxhash.xxh3_128_digest(parent + packed[i * width : (i + 1) * width])
            digests.append(parent)
        return digests
