"""LlamaIndex components over ragkv (``pip install 'ragkv[llama-index]'``, llama-index-core 0.14).

- :class:`DedupPostprocessor`: byte-exact dedup on the text the LLM sees, merged scores,
  cache-friendly order.
- :class:`RagKVLLM`: a ``CustomLLM`` over :class:`ragkv.cache_engine.Engine`, reporting
  OpenAI-shaped usage with ``prompt_tokens_details.cached_tokens``.
- :class:`RagKVSynthesizer`: a response synthesizer that hands the nodes to
  :class:`ragkv.Pipeline` as chunks (dedup + token-level, cache-friendly assembly).
"""

from ragkv.integrations._extras import require

require("llama_index.core", "llama-index-core", "llama-index")

from ragkv.integrations.llama_index.llm import RagKVLLM  # noqa: E402
from ragkv.integrations.llama_index.postprocessor import DedupPostprocessor  # noqa: E402
from ragkv.integrations.llama_index.synthesizer import RagKVSynthesizer, node_to_chunk  # noqa: E402

__all__ = ["DedupPostprocessor", "RagKVLLM", "RagKVSynthesizer", "node_to_chunk"]
