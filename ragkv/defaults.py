"""Defaults that more than one stage must agree on, each defined once.

A leaf module, like :mod:`ragkv.errors`: every stage may import it, and it imports nothing
of ragkv. The default answer length lives with the sampling settings
(:data:`ragkv.cache_engine.sampling_params.DEFAULT_MAX_TOKENS`); what is here is shared by
stages that may not import each other.
"""

from __future__ import annotations

# Tokens per KV block. The engine caches whole blocks only (Invariant 2), and the assembler
# aligns its plans to the same blocks, so both read this one number (vLLM's default too).
DEFAULT_BLOCK_SIZE = 16
