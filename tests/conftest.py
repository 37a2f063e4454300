"""Test-wide setup. TRITON_INTERPRET must be set before any kernel (or triton) import."""

import os
import sys
from pathlib import Path

import pytest

# `python -m pytest` (and a child's `python -c` / `-m`) puts the checkout root on sys.path,
# where `kernels/` (ragkv.kernels' source) shadows Hugging Face's `kernels` package, which
# transformers >= 5.25 imports. ragkv is installed (editable), so the root is never needed.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]
os.environ["PYTHONSAFEPATH"] = "1"
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
