"""``ragkv serve``: one engine behind an OpenAI-compatible HTTP API.

``app`` builds the FastAPI app (routes, chat prompts); ``streaming`` answers a generation,
``errors`` maps failures to OpenAI error bodies, ``auth`` is the gate (hosts, API keys,
tenants), ``metrics`` the Prometheus export, ``settings`` the server's defaults and tenant
and host policy, ``cli`` the ``ragkv serve`` command on top of them all, ``thread`` runs an
app in a background thread. Only ``settings`` and ``cli`` may be imported without FastAPI
installed, so this package imports none of them.
"""
