"""What a disk store's entries belong to: the model setup they were computed with.

A store directory holds one subdirectory per :class:`StoreNamespace`, named by its digest.
Anything that changes the K/V of a block for the same hash input (other weights at the same
path, another dtype, block size, hash algorithm or payload layout) is part of the namespace,
so an engine only ever sees entries computed by an identical setup (Invariant 7,
docs/invariants.md). The salt is not: it is part of every block's hash input, verified on load.
"""

from __future__ import annotations

import json
import mmap
from dataclasses import asdict, dataclass
from pathlib import Path

import xxhash

# Files whose bytes are the weights (and what shapes them), as transformers and GGUF save them.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json")
NAMESPACE_VERSION = 1


@dataclass(slots=True, frozen=True)
class StoreNamespace:
    """The model setup a disk store's entries were computed with."""

    model_identity: str
    weights_fingerprint: str
    dtype: str
    block_size: int
    hash_algo: str
    layout: str

    def digest(self) -> str:
        """A stable 32-hex-digit name for the namespace's directory."""
        fields = {"version": NAMESPACE_VERSION, **asdict(self)}
        return xxhash.xxh3_128_hexdigest(json.dumps(fields, sort_keys=True).encode())

    def to_json(self) -> str:
        """The namespace in clear, written beside its entries for people (never trusted)."""
        return json.dumps({"version": NAMESPACE_VERSION, **asdict(self)}, indent=2, sort_keys=True)


def weights_fingerprint(path: str | Path) -> str:
    """xxh3_128 over the name, size and full content of every weight and config file.

    ``path`` is a checkpoint directory (or a single weight file). The whole content is
    hashed, not a sample: one changed weight anywhere must change the fingerprint. xxh3 runs
    at memory speed, so this costs about as much as reading the files once (measured in the
    docs/python_api.md, "KV tiers").
    """
    path = Path(path)
    files = (
        [path]
        if path.is_file()
        else sorted(p for p in path.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    )
    hasher = xxhash.xxh3_128()
    for file in files:
        size = file.stat().st_size
        hasher.update(f"{file.name}\0{size}\0".encode())
        if size:
            with (
                open(file, "rb") as handle,
                mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as view,
            ):
                hasher.update(view)
    return hasher.hexdigest()
