"""ragkv and the OpenAI wire format, as one package.

- :mod:`.protocol`, :mod:`.responses`, :mod:`.schemas`: the request and response shapes
  (``ragkv serve``'s parsing, bodies and JSON Schemas); :mod:`.limits`: what a request may
  hold and :class:`~.limits.APIError`, the refusal.
- :mod:`.client`: :class:`RemoteEngine`, an :class:`~ragkv.cache_engine.engine_like.EngineLike`
  over any OpenAI-compatible server (httpx only); :mod:`.client_reader` reads its answers;
  :mod:`.tokenizer`: :func:`load_tokenizer`, the server model's tokenizer it assembles with.
- :mod:`.server`: ``ragkv serve``, the FastAPI app (``pip install ragkv[server]``).

Routing over several replicas is not an OpenAI feature but an engine combinator:
:mod:`ragkv.integrations.routing`.

Names load lazily: ``ragkv --help`` imports the server's CLI module, which must not pull
in httpx clients or FastAPI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ragkv._lazy import lazy_attributes

if TYPE_CHECKING:
    from ragkv.integrations.openai.client import RemoteEngine
    from ragkv.integrations.openai.tokenizer import load_tokenizer


__getattr__ = lazy_attributes(
    __name__,
    {
        "RemoteEngine": "ragkv.integrations.openai.client",
        "load_tokenizer": "ragkv.integrations.openai.tokenizer",
    },
)


__all__ = ["RemoteEngine", "load_tokenizer"]
