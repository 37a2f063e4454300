"""Pause Python's cyclic garbage collector around allocation-heavy, cycle-free work.

Building 100k survivor chunks allocates ~300k container objects; on CPython 3.11 the
collector's generation-2 passes over everything allocated so far then cost more than
hashing the chunks (measured: ~4x the allocation time). Dedup creates no reference
cycles, so nothing is lost by deferring collection to the end of the call. A counter makes
nested or concurrent pauses safe: the collector is re-enabled when the last one exits,
and only if it was enabled when the first one entered.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def paused_gc() -> Iterator[None]:
    """Disable the cyclic GC inside the block (reference counting still frees memory)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
