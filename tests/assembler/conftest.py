"""Tokenizers for the assembler tests: a small byte-level BPE trained here, and (from
``tests/conftest.py``) the shipped one."""

from __future__ import annotations

import pydoc_data.topics

import pytest
from support import CHATML, train_byte_level_bpe
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast


@pytest.fixture(scope="session")
def bpe() -> Tokenizer:
    return train_byte_level_bpe(list(pydoc_data.topics.topics.values())[:20], vocab_size=600)


@pytest.fixture(scope="session")
def local_tokenizer(bpe: Tokenizer) -> PreTrainedTokenizerFast:
    """A byte-level BPE with a ChatML chat template."""
    return PreTrainedTokenizerFast(tokenizer_object=bpe, chat_template=CHATML)


@pytest.fixture(scope="session")
def plain_tokenizer(bpe: Tokenizer) -> PreTrainedTokenizerFast:
    """The same BPE without a chat template (plain layout)."""
    return PreTrainedTokenizerFast(tokenizer_object=bpe)


@pytest.fixture(params=["local", "shipped"])
def any_tokenizer(request):
    """Each test using this runs on the local BPE and on the shipped tokenizer."""
    name = "local_tokenizer" if request.param == "local" else "shipped_tokenizer"
    return request.getfixturevalue(name)
