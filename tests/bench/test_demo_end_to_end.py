"""`ragkv demo --quick` on the embedded default model: answers, chunk previews, lane table."""

from __future__ import annotations

import json

from ragkv.cli import main


def test_quick_demo_shows_answers_deduplicated_chunks_and_all_lanes(capsys):
    assert main(["demo", "--quick", "--json", "--no-progress"]) == 0
    result = json.loads(capsys.readouterr().out)
    examples = result["examples"]
    assert len(examples) == 2
    for example in examples:
        assert isinstance(example["answer"], str)
        assert len(example["chunks"]) == example["chunks_in"] == 12
        kept = [c for c in example["chunks"] if not c["duplicate"]]
        assert len(kept) == example["chunks_out"] < example["chunks_in"]
    lanes = result["report"]["lanes"]
    assert list(lanes) == ["no-cache", "apc", "apc+assembler", "ragkv"]
    assert lanes["ragkv"]["prefill_tokens_computed"] < lanes["no-cache"]["prefill_tokens_computed"]
