"""Which checkpoints the engine can run, decided from ``config.json`` before loading weights."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ragkv.errors import ModelNotFoundError, UnsupportedModelError

# Decoder-only families with full (global) causal attention on every layer, whose
# attention modules call transformers' attention interface with a ``layer_idx``.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})

_RECURRENT_HINTS = ("mamba", "ssm", "rwkv", "linear_attention", "gated_delta", "conv_kernel")


def read_config(path: Path) -> dict[str, Any]:
    """The checkpoint's ``config.json`` as a dict; a clear error if the directory is not one."""
    config_file = path / "config.json"
    if not path.is_dir():
        hint = ""
        if len(path.parts) == 2 and not str(path).startswith((".", "/", "~")):
            hint = (
                f"; {str(path)!r} looks like a Hugging Face hub id, but ragkv loads only local "
                f"directories (nothing is downloaded): run `hf download {path} --local-dir "
                "DIR` where there is network, then pass DIR"
            )
        raise ModelNotFoundError(f"model directory {path} does not exist{hint}")
    if not config_file.is_file():
        raise ModelNotFoundError(
            f"{path} has no config.json; pass a local Hugging Face checkpoint directory "
            "(config.json, *.safetensors, tokenizer files)"
        )
    return json.loads(config_file.read_text())


def check_files(path: Path) -> None:
    """A clear error for a checkpoint directory without weights or tokenizer files, before
    transformers fails on it with an ``OSError`` about the hub."""
    weights = [p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth")]
    tokenizer = [
        p for p in ("tokenizer.json", "tokenizer.model", "vocab.json") if (path / p).exists()
    ]
    missing = [
        what
        for what, found in (
            ("weights (*.safetensors)", weights),
            ("tokenizer files (tokenizer.json)", tokenizer),
        )
        if not found
    ]
    if missing:
        raise ModelNotFoundError(
            f"{path} has a config.json but no {' and no '.join(missing)}; a checkpoint "
            "directory needs config.json, the weights and the tokenizer files"
        )


def check_supported(config: dict[str, Any]) -> None:
    """Raise :class:`UnsupportedModelError` naming what the engine cannot run exactly."""
    model_type = config.get("model_type", "<missing>")
    if config.get("is_encoder_decoder"):
        raise UnsupportedModelError(
            f"model_type {model_type!r} is an encoder-decoder model; ragkv runs decoder-only "
            f"causal LMs ({', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
        )
    layer_kinds = set(config.get("layer_types") or []) - {"full_attention"}
    if "sliding_attention" in layer_kinds or _uses_sliding_window(config):
        raise UnsupportedModelError(
            f"model_type {model_type!r} uses sliding-window attention "
            f"(sliding_window={config.get('sliding_window')}); ragkv's paged attention is full "
            "causal attention, so its outputs would differ. Set sliding_window to null in "
            "config.json if the model was trained without it"
        )
    recurrent = sorted(k for k in config if any(h in k for h in _RECURRENT_HINTS))
    if layer_kinds or recurrent:
        raise UnsupportedModelError(
            f"model_type {model_type!r} has hybrid or recurrent layers "
            f"({', '.join(sorted(layer_kinds) + recurrent)}); paged prefix caching needs "
            "attention-only models"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported families: "
            f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
        )


def _uses_sliding_window(config: dict[str, Any]) -> bool:
    window = config.get("sliding_window")
    if window is None:
        return False
    if config.get("use_sliding_window") is False:  # Qwen2/Qwen3 carry the field but keep it off
        return False
    max_positions = config.get("max_position_embeddings") or 0
    return window < max_positions


def model_identity(path: Path, config: dict[str, Any], dtype: str) -> bytes:
    """Identity of (checkpoint, dtype) for block hashes: path + config hash + dtype."""
    config_hash = hashlib.blake2b(
        json.dumps(config, sort_keys=True).encode(), digest_size=16
    ).hexdigest()
    return f"{path.resolve()}|{config_hash}|{dtype}".encode()
