"""The pipeline a framework adapter answers with: the caller's own, or one built from options.

Framework-neutral: :func:`create_rag_chain` (LangChain) and ``RagKVSynthesizer``
(LlamaIndex) accept a ready :class:`ragkv.Pipeline`, so its options are declared once,
on ``Pipeline``; their older keyword options (:class:`PipelineOptions`, declared here once
for both) still build one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypedDict, Unpack

from ragkv.cache_engine.chunk_reuse import BlendConfig
from ragkv.cache_engine.engine_like import EngineLike
from ragkv.dedup import Deduplicator
from ragkv.errors import ConfigError
from ragkv.pipeline import Pipeline


class PipelineOptions(TypedDict, total=False):
    """The :class:`ragkv.Pipeline` options an adapter takes in place of a ready pipeline
    (each as ``Pipeline`` takes it; None or left out: ``Pipeline``'s default)."""

    deduplicator: Deduplicator | None
    order: str | None
    max_prompt_tokens: int | None
    reuse: str | None
    blend: BlendConfig | None


def pipeline_for(
    pipeline: Pipeline | None,
    engine: Callable[[], EngineLike],
    **options: Unpack[PipelineOptions],
) -> Pipeline:
    """``pipeline`` as given, or a new one on ``engine()`` with the ``options`` that are not
    None (the rest: ``Pipeline``'s defaults). Options next to a pipeline are a
    :class:`~ragkv.errors.ConfigError`: the pipeline already decided them."""
    unknown = set(options) - set(PipelineOptions.__annotations__)
    if unknown:  # what a keyword parameter would refuse, and the same error
        raise TypeError(f"unexpected keyword argument {sorted(unknown)[0]!r}")
    given: dict[str, Any] = {name: value for name, value in options.items() if value is not None}
    if pipeline is None:
        return Pipeline(engine(), **given)
    if not isinstance(pipeline, Pipeline):
        raise ConfigError(f"expected a ragkv.Pipeline, got {type(pipeline).__name__}")
    if given:
        raise ConfigError(
            f"{', '.join(sorted(given))}: pass these to ragkv.Pipeline(...) when a pipeline "
            "is given, not next to it",
            param=sorted(given)[0],
        )
    return pipeline
