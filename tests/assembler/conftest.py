"""Tokenizers for the assembler tests: a small byte-level BPE trained here, and the shipped one."""

from __future__ import annotations

import pydoc_data.topics

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _train_byte_level_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = list(pydoc_data.topics.topics.values())[:20]
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


@pytest.fixture(scope="session")
def bpe() -> Tokenizer:
    return _train_byte_level_bpe()


@pytest.fixture(scope="session")
def local_tokenizer(bpe: Tokenizer) -> PreTrainedTokenizerFast:
    """A byte-level BPE with a ChatML chat template."""
    return PreTrainedTokenizerFast(tokenizer_object=bpe, chat_template=CHATML)


@pytest.fixture(scope="session")
def plain_tokenizer(bpe: Tokenizer) -> PreTrainedTokenizerFast:
    """The same BPE without a chat template (plain layout)."""
    return PreTrainedTokenizerFast(tokenizer_object=bpe)


@pytest.fixture(scope="session")
def shipped_tokenizer():
    """The embedded SmolLM2-135M-Instruct tokenizer, or a skip saying why it is missing."""
    from transformers import AutoTokenizer

    from ragkv.cache_engine import default_model_path
    from ragkv.errors import ModelNotFoundError

    try:
        path = default_model_path(progress=False)
    except ModelNotFoundError as exc:
        pytest.skip(f"embedded default model not installed: {exc}")
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(params=["local", "shipped"])
def any_tokenizer(request):
    """Each test using this runs on the local BPE and on the shipped tokenizer."""
    name = "local_tokenizer" if request.param == "local" else "shipped_tokenizer"
    return request.getfixturevalue(name)
