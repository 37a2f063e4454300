"""Synthetic and trace workloads: seeded, duplicates kept, sessions, exact trace lengths."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from support import tiny_tokenizer

from ragkv.bench.workload import segment_text, synthetic_workload, trace_workload, word_vocabulary
from ragkv.errors import ConfigError, InvalidInputError


def _shape(workload):
    return [
        (r.session_id, r.system, r.question, [c.text for c in r.chunks], r.follow_up)
        for r in workload.requests
    ]


def test_the_same_seed_gives_the_same_workload_and_another_seed_does_not(small_config):
    first = synthetic_workload(small_config(requests=20))
    assert _shape(first) == _shape(synthetic_workload(small_config(requests=20)))
    assert _shape(first) != _shape(synthetic_workload(small_config(requests=20, seed=2)))


def test_multi_query_retrieval_keeps_duplicates(small_config):
    workload = synthetic_workload(small_config(requests=20))
    for request in workload.requests:
        assert len(request.chunks) == 3 * 4  # query variants x top-k, union with duplicates
    assert any(len({c.text for c in r.chunks}) < len(r.chunks) for r in workload.requests)


def test_follow_ups_continue_an_earlier_session_on_its_topic(small_config):
    workload = synthetic_workload(small_config(requests=40, follow_up_rate=0.5))
    first_seen = {}
    follow_ups = 0
    for request in workload.requests:
        if request.follow_up:
            follow_ups += 1
            assert first_seen[request.session_id] == request.topic
        else:
            assert request.session_id not in first_seen
            first_seen[request.session_id] = request.topic
    assert follow_ups > 0
    assert workload.params["num_sessions"] == len(first_seen)


def test_timestamps_make_every_system_prompt_distinct(small_config):
    stamped = synthetic_workload(small_config(requests=10))
    assert len({r.system for r in stamped.requests}) == 10
    plain = synthetic_workload(small_config(requests=10, timestamp=False))
    assert len({r.system for r in plain.requests}) == 1


def test_zipf_popularity_favours_the_head_topic(small_config):
    workload = synthetic_workload(small_config(requests=60, topics=10, zipf_s=2.0))
    counts = Counter(r.topic for r in workload.requests if not r.follow_up).most_common()
    assert counts[0][1] > 3 * counts[-1][1]


def test_bad_knobs_are_rejected(small_config):
    with pytest.raises(ConfigError):
        synthetic_workload(small_config(follow_up_rate=1.5))


def _write_trace(tmp_path, lines, lengths):
    trace, table = tmp_path / "t.jsonl", tmp_path / "len.json"
    trace.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    table.write_text(json.dumps(lengths))
    return trace, table


def test_trace_segments_retokenize_to_exactly_their_listed_lengths(tmp_path):
    tokenizer = tiny_tokenizer()
    lengths = {"sys": 7, "p1": 30, "p2": 11, "q1": 5, "h1": 4, "h2": 6}
    lines = [
        {"session_id": "a", "system": ["sys"], "passages": ["p1", "p2", "p1"], "user": ["q1"]},
        {
            "session_id": "a",
            "system": ["sys"],
            "passages": ["p2"],
            "history": ["h1", "h2"],
            "user": ["q1"],
        },
    ]
    workload = trace_workload(*_write_trace(tmp_path, lines, lengths), tokenizer, seed=4)
    first, second = workload.requests
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert [len(encode(part)) for part in first.system] == [7]  # one part per id
    assert len(encode(first.question)) == 5
    assert [len(encode(c.text)) for c in first.chunks] == [30, 11, 30]
    assert first.chunks[0].text == first.chunks[2].text
    assert second.chunks[0].text == first.chunks[1].text
    assert [t["role"] for t in second.history] == ["user", "assistant"]
    assert second.follow_up and not first.follow_up


def test_segment_text_depends_only_on_id_and_seed():
    vocab = word_vocabulary(tiny_tokenizer())
    assert segment_text("x", 20, vocab, 1) == segment_text("x", 20, vocab, 1)
    assert segment_text("x", 20, vocab, 1) != segment_text("y", 20, vocab, 1)
    assert segment_text("x", 20, vocab, 1) != segment_text("x", 20, vocab, 2)


def test_trace_with_an_unknown_segment_id_is_rejected(tmp_path):
    paths = _write_trace(tmp_path, [{"passages": ["nope"], "user": ["q"]}], {"q": 3})
    with pytest.raises(InvalidInputError, match="nope"):
        trace_workload(*paths, tiny_tokenizer())
