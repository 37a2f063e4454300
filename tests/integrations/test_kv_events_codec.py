"""vLLM's KV event batches through ragkv's codec: both forms, unknown fields, real frames."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

msgpack = pytest.importorskip("msgpack")

from ragkv.cache_engine.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from ragkv.errors import InvalidInputError  # noqa: E402
from ragkv.integrations.kv_events.codec import decode_batch, encode_batch  # noqa: E402

REAL_FRAMES = Path(__file__).resolve().parents[3] / "shared/data/vllm-kv-events"
REAL_FILE = REAL_FRAMES / "vllm-0.32-cpu-events.json"


def _every_field_batch() -> KVEventBatch:
    stored = BlockStored(
        block_hashes=[2**64 - 1, 7],
        parent_block_hash=12345,
        token_ids=list(range(8)),
        block_size=4,
        lora_id=3,
        medium="CPU",
        lora_name="adapter",
        extra_keys=[["tenant"], None],
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=128,
    )
    removed = BlockRemoved(block_hashes=[7, b"\x01" * 32], medium="DISK", group_idx=0)
    return KVEventBatch(1.5, [AllBlocksCleared(), stored, removed], data_parallel_rank=2)


@pytest.mark.parametrize("form", ["map", "array"])
def test_every_vllm_field_round_trips(form):
    batch = _every_field_batch()
    assert decode_batch(encode_batch(batch, form=form)) == batch


def test_map_form_ignores_unknown_fields_and_event_types():
    payload = msgpack.packb(
        [
            2.0,
            [
                {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "new": {"x": 1}},
                {"type": "BlockPinned", "block_hashes": [1]},
                {"type": "AllBlocksCleared", "medium": None},
            ],
            None,
            "a field after the rank",
        ]
    )
    batch = decode_batch(payload)
    assert batch.events == [BlockRemoved([1], "GPU"), AllBlocksCleared()]
    assert batch.data_parallel_rank is None


def test_array_form_of_older_and_newer_vllm():
    # vLLM 0.9: no medium, no lora_name, no rank; a later one: an extra trailing field.
    old = msgpack.packb([1.0, [["BlockStored", [5], None, [1, 2], 2, None]]])
    new = msgpack.packb(
        [1.0, [["BlockStored", [5], None, [1, 2], 2, None, "GPU", None, None, 0, "x", 4, "?"]], 0]
    )
    (stored_old,) = decode_batch(old).events
    assert stored_old == BlockStored([5], None, [1, 2], 2)
    (stored_new,) = decode_batch(new).events
    assert stored_new.kv_cache_spec_sliding_window == 4 and stored_new.medium == "GPU"


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # never valid msgpack
        msgpack.packb({"events": 3}),
        msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]),
        msgpack.packb(
            [1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 2}]]
        ),
        msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": "ab"}]]),
        msgpack.packb([1.0, [17]]),
    ],
)
def test_malformed_payloads_are_refused(payload):
    with pytest.raises(InvalidInputError):
        decode_batch(payload)


def _frames(message: list[str]) -> list[bytes]:
    return [base64.b64decode(part) for part in message]


@pytest.mark.skipif(not REAL_FILE.exists(), reason="shared/data/vllm-kv-events not present")
def test_real_vllm_frames_decode():
    data = json.loads(REAL_FILE.read_text())
    seqs = []
    stored = []
    for message in data["published"]:
        topic, seq, payload = _frames(message)
        assert topic == b"kv@smol"
        seqs.append(int.from_bytes(seq, "big", signed=True))
        batch = decode_batch(payload)
        assert batch.data_parallel_rank == 0 and batch.ts > 0
        stored += batch.events
    assert seqs == list(range(len(seqs)))
    assert all(isinstance(e, BlockStored) and e.medium == "GPU" for e in stored)
    assert all(e.block_size == 32 and len(e.token_ids) == 32 * len(e.block_hashes) for e in stored)
    assert all(isinstance(h, int) for e in stored for h in e.block_hashes)
    assert [e.extra_keys[0] for e in stored] == [None, ["tenant-x"], None]

    replies = [_frames(m) for m in data["replay_from_0"]]
    assert replies[-1] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
    for (empty, topic, seq, payload), published in zip(replies, data["published"], strict=False):
        assert empty == b"" and topic == b"kv@smol"
        assert decode_batch(payload) == decode_batch(_frames(published)[2])
        assert seq == _frames(published)[1]
