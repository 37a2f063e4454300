"""The tokenizer of a model served elsewhere: what :class:`RemoteEngine` and
:meth:`ReplicaRouter.from_urls <ragkv.integrations.routing.ReplicaRouter.from_urls>` assemble
token ids with, so that the ids they send are the prompt the server would have tokenized.

transformers loads inside :func:`load_tokenizer`, so importing this module stays cheap.
"""

from __future__ import annotations

import os
from typing import Any

from ragkv.errors import InvalidInputError

EMBEDDED = "embedded"  # tokenizer="embedded": the embedded default model's, offline


def load_tokenizer(tokenizer: Any) -> Any:
    """The tokenizer object for ``tokenizer``, which names a server's model.

    ``tokenizer`` is ``"embedded"`` (the embedded default model's, what ``ragkv serve``
    without ``--model`` serves), a local tokenizer directory, a hub id already in the local
    Hugging Face cache, or a tokenizer object (returned as it is). Never downloads: offline,
    a missing tokenizer is one clear :class:`~ragkv.errors.InvalidInputError` at once
    instead of a minute of retries; ``None`` is one too.
    """
    if tokenizer is None:
        raise InvalidInputError(
            "RemoteEngine needs the server's tokenizer: 'embedded' (a ragkv serve of the "
            "embedded model), a local tokenizer directory, or a tokenizer object",
            param="tokenizer",
        )
    if not isinstance(tokenizer, str | os.PathLike):
        return tokenizer
    from transformers import AutoTokenizer

    if tokenizer == EMBEDDED:
        from ragkv.cache_engine import default_model_path

        return AutoTokenizer.from_pretrained(default_model_path())
    try:
        return AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    except OSError as exc:
        raise InvalidInputError(
            f"no tokenizer found for {str(tokenizer)!r} on this machine (local directory or "
            "the local Hugging Face cache; ragkv downloads nothing: `hf download ID "
            "--local-dir DIR` where there is network). Pass the server model's tokenizer "
            "directory, or tokenizer='embedded' for a ragkv serve of the embedded model "
            f"({exc.__class__.__name__}: {str(exc)[:200]})",
            param="tokenizer",
        ) from exc
