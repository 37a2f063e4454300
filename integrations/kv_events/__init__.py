"""KV cache events on the wire, in vLLM's format (``pip install ragkv[events]``).

- :mod:`.codec`: a batch of :mod:`ragkv.cache_engine.kv_events` records to msgpack bytes
  and back (vLLM's map form and its older positional-array form; unknown fields and event
  types are ignored).
- :mod:`.publisher`: ``ragkv serve``'s ZMQ PUB socket and its replay socket.
- :mod:`.subscriber`: a ZMQ SUB socket on one replica's publisher, with replay.

The wire, as vLLM's ``KVEventsConfig`` publisher speaks it: each message is three frames,
``topic``, ``seq`` (8-byte big-endian, +1 per batch) and the msgpack payload
``[ts, [event, ...], data_parallel_rank]``. Replay: a client sends ``[b"", start_seq]`` to
the ROUTER socket and gets ``[b"", topic, seq, payload]`` per buffered batch from
``start_seq`` on, then ``[b"", b"", -1, b""]``.
"""
