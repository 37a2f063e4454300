"""MuSiQue loading and SQuAD's answer F1 (what the blend quality harness scores with)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ragkv.bench.musique import load_musique, normalize_answer, token_f1
from ragkv.errors import InvalidInputError

SHARED = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "musique"


def test_squad_normalisation_drops_case_punctuation_and_articles():
    assert normalize_answer("The  Exeter College, Oxford!") == "exeter college oxford"
    assert normalize_answer("an apple a day") == "apple day"
    assert normalize_answer("theatre") == "theatre"  # an article only as a whole word


def test_token_f1_scores_overlap_after_normalisation():
    assert token_f1("Exeter College.", "the exeter college") == 1.0
    assert token_f1("at Exeter", "Exeter College") == pytest.approx(0.5)
    assert token_f1("Oxford", "Exeter College") == 0.0
    assert token_f1("", "") == 1.0 and token_f1("the", "Exeter") == 0.0


def test_malformed_examples_are_refused_with_their_number(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"question": "q", "answers": [], "ctxs": [{"text": "t"}]}]))
    with pytest.raises(InvalidInputError, match="example 0"):
        load_musique(path)
    path.write_text(json.dumps({"question": "q"}))
    with pytest.raises(InvalidInputError, match="JSON list"):
        load_musique(path)


@pytest.mark.skipif(not SHARED.is_dir(), reason="the shared MuSiQue file is not present")
def test_the_shared_file_loads_ten_passages_per_example():
    examples = load_musique(SHARED / "musique_dev.json", limit=3)
    assert len(examples) == 3
    assert all(len(e.passages) == 10 and e.question and e.answers for e in examples)


@pytest.mark.parametrize("answers", ["Paris", None, [1]])
def test_answers_that_are_not_a_list_of_strings_are_refused(tmp_path, answers):
    item = {"question": "q?", "answers": answers, "ctxs": [{"title": "t", "text": "x"}]}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([item]), encoding="utf-8")
    with pytest.raises(InvalidInputError, match="example 0's answers"):
        load_musique(path)
    with pytest.raises(InvalidInputError, match="limit"):
        load_musique(path, limit=-1)
