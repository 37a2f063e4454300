"""The official langchain-tests suites for ChatRagKV (on the embedded default model) and
DedupRetriever (over an in-memory vector store holding duplicated passages)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("langchain_tests")

from langchain_core.embeddings import DeterministicFakeEmbedding  # noqa: E402
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage  # noqa: E402
from langchain_core.vectorstores import InMemoryVectorStore  # noqa: E402
from langchain_tests.integration_tests import (  # noqa: E402
    ChatModelIntegrationTests,
    RetrieversIntegrationTests,
)
from langchain_tests.unit_tests import ChatModelUnitTests  # noqa: E402

from ragkv.integrations.langchain import ChatRagKV, DedupRetriever  # noqa: E402

# Keeps every standard call short on the CPU: the suite checks the protocol, not prose.
MAX_TOKENS = 16

PASSAGES = [
    "Paged attention stores keys and values in fixed-size blocks.",
    "Prefix caching reuses the blocks of a shared prompt prefix.",
    "Byte-exact dedup removes repeated retrieved chunks.",
    "The scheduler batches prefill and decode steps together.",
    "Paged attention stores keys and values in fixed-size blocks.",  # a re-ingested copy
    "A cache salt keeps tenants from sharing blocks.",
]


class ChatRagKVUnderTest:
    """What both chat model suites are told about ChatRagKV."""

    @property
    def chat_model_class(self) -> type[ChatRagKV]:
        return ChatRagKV

    @property
    def supports_model_override(self) -> bool:
        return False  # one engine serves one model; `model=` per call cannot switch weights


class TestChatRagKVUnit(ChatRagKVUnderTest, ChatModelUnitTests):
    pass


@pytest.mark.slow
class TestChatRagKVIntegration(ChatRagKVUnderTest, ChatModelIntegrationTests):
    @property
    def chat_model_params(self) -> dict[str, Any]:
        # model=None: the embedded default model, loaded once per process and shared.
        return {"max_tokens": MAX_TOKENS}

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[str]]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        model = ChatRagKV(**self.chat_model_params)
        messages = [
            SystemMessage("You answer questions about KV caches in one short sentence."),
            HumanMessage("What does prefix caching reuse?"),
        ]
        model.invoke(messages)  # the first call fills the prefix cache
        if stream:
            full = None
            for chunk in model.stream(messages):
                full = chunk if full is None else full + chunk
            message = full
        else:
            message = model.invoke(messages)
        assert message.usage_metadata["input_token_details"]["cache_read"] > 0
        return message


class TestDedupRetrieverStandard(RetrieversIntegrationTests):
    @property
    def retriever_constructor(self) -> type[DedupRetriever]:
        return DedupRetriever

    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        store = InMemoryVectorStore(DeterministicFakeEmbedding(size=16))
        store.add_texts(PASSAGES)
        # fetch_k: ask the store for enough passages that k unique ones survive dedup.
        return {"base_retriever": store.as_retriever(), "k": 3, "fetch_k": len(PASSAGES)}

    @property
    def retriever_query_example(self) -> str:
        return "How are keys and values stored?"
