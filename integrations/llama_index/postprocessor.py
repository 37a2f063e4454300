"""``DedupPostprocessor``: byte-exact dedup of retrieved nodes on their content."""

from __future__ import annotations

from typing import Any

from llama_index.core.bridge.pydantic import Field
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle

from ragkv.dedup import Deduplicator
from ragkv.integrations._documents import Survivor, check_doc_order, dedupe_and_order
from ragkv.integrations.llama_index.synthesizer import node_to_chunk


class DedupPostprocessor(BaseNodePostprocessor):
    """Drop nodes whose content is byte-identical to an earlier node's, whatever their node
    ids and metadata; keep the best score (the survivor's ``ragkv_sources`` lists every
    copy). ``metadata_mode=MetadataMode.LLM`` compares the LLM-visible text instead, so the
    same passage from two files (their ``file_name`` differs) is kept twice.

    LlamaIndex itself only merges nodes with the same id; the same passage stored twice
    (re-ingested files, overlapping sources, copies in several files) reaches the prompt
    twice. Survivors are ordered
    by content hash (``order="canonical"``: the same set in any retrieval order gives the
    same prompt prefix) or kept in retrieval order (``"retrieval"``). Each survivor's
    metadata gains ``ragkv_rank``, ``ragkv_sources``, ``ragkv_duplicates`` and
    ``ragkv_content_hash``, excluded from the LLM and embedding text.
    """

    deduplicator: Any = Field(default_factory=Deduplicator, exclude=True)
    order: str = "canonical"
    metadata_mode: MetadataMode = MetadataMode.NONE

    def model_post_init(self, context: Any) -> None:
        check_doc_order(self.order)

    @classmethod
    def class_name(cls) -> str:
        return "RagKVDedupPostprocessor"

    def _postprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        chunks = [node_to_chunk(n, self.metadata_mode) for n in nodes]
        survivors = dedupe_and_order(chunks, self.deduplicator, self.order)
        return [_annotated(nodes[s.index], s) for s in survivors]


def _annotated(item: NodeWithScore, survivor: Survivor) -> NodeWithScore:
    # A copy, so the stored node is untouched; the new keys must not change the LLM text.
    node = item.node
    extra = survivor.metadata()
    copy = node.model_copy(
        update={
            "metadata": {**node.metadata, **extra},
            "excluded_llm_metadata_keys": [*node.excluded_llm_metadata_keys, *extra],
            "excluded_embed_metadata_keys": [*node.excluded_embed_metadata_keys, *extra],
        }
    )
    return NodeWithScore(node=copy, score=survivor.score)
