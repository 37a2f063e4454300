"""LangChain components over ragkv (``pip install 'ragkv[langchain]'``, langchain-core 1.x).

- :class:`DedupRetriever`: wraps any retriever; byte-exact dedup, cache-friendly order.
- :class:`DedupCompressor`: the same as a document compressor / transformer.
- :class:`ChatRagKV`: a chat model over :class:`ragkv.cache_engine.Engine` that reports
  ``usage_metadata.input_token_details.cache_read``.
- :func:`create_rag_chain`: question → retrieve → dedup → token-level assembly → engine.
"""

from ragkv.integrations._extras import require

require("langchain_core", "langchain-core", "langchain")

from ragkv.integrations.langchain.chain import create_rag_chain  # noqa: E402
from ragkv.integrations.langchain.chat_model import ChatRagKV  # noqa: E402
from ragkv.integrations.langchain.compressor import DedupCompressor  # noqa: E402
from ragkv.integrations.langchain.documents import (  # noqa: E402
    dedupe_documents,
    document_to_chunk,
)
from ragkv.integrations.langchain.retriever import DedupRetriever  # noqa: E402

__all__ = [
    "ChatRagKV",
    "DedupCompressor",
    "DedupRetriever",
    "create_rag_chain",
    "dedupe_documents",
    "document_to_chunk",
]
