"""``ragkv serve``: one engine behind an OpenAI-compatible HTTP API.

``app`` builds the FastAPI app (routes, chat prompts); ``streaming`` answers a generation,
``errors`` maps failures to OpenAI error bodies, ``auth`` is the gate (hosts, API keys,
tenants), ``metrics`` the Prometheus export, ``cli`` the framework-free ``ragkv serve``
parser, ``thread`` runs an app in a background thread. Only ``cli`` may be imported without
FastAPI installed, so this package imports none of them.
"""
