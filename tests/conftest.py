"""Test-wide setup. TRITON_INTERPRET must be set before any kernel (or triton) import."""

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
