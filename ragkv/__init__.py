"""ragkv: cheaper, faster retrieval-augmented generation.

Three stages, in data-flow order: :mod:`ragkv.dedup` collapses byte-identical retrieved
chunks, :mod:`ragkv.assembler` builds token-level prompts in a canonical, cache-friendly
order, and :mod:`ragkv.cache_engine` runs the model with paged prefix caching.

Heavy submodules (torch, transformers) load lazily: ``import ragkv`` stays cheap, and a
stage importing :mod:`ragkv.errors` never cycles back through this file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ragkv._lazy import lazy_attributes
from ragkv._version import __version__
from ragkv.errors import RagkvError

if TYPE_CHECKING:
    from ragkv.assembler import SystemPrompt, Volatile
    from ragkv.cache_engine import Engine, EngineConfig, SamplingParams
    from ragkv.cache_engine.chunk_reuse import BlendConfig
    from ragkv.pipeline import Answer, Pipeline

__getattr__ = lazy_attributes(
    __name__,
    {
        "Pipeline": "ragkv.pipeline",
        "Answer": "ragkv.pipeline",
        "BlendConfig": "ragkv.cache_engine.chunk_reuse",
        "Engine": "ragkv.cache_engine",
        "EngineConfig": "ragkv.cache_engine",
        "SamplingParams": "ragkv.cache_engine",
        "SystemPrompt": "ragkv.assembler",
        "Volatile": "ragkv.assembler",
    },
)


__all__ = [
    "Answer",
    "BlendConfig",
    "Engine",
    "EngineConfig",
    "Pipeline",
    "RagkvError",
    "SamplingParams",
    "SystemPrompt",
    "Volatile",
    "__version__",
]
