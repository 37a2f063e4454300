"""What the model reads: ``answer.prompt_text``, ``learn_system=False``, and the documented
before/after example, reproduced with the embedded model's tokenizer (no model run)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import ragkv
from ragkv.assembler import Assembler
from ragkv.bench.simulated import SimulatedEngine
from ragkv.cache_engine import SamplingParams, default_model_path
from ragkv.errors import ConfigError

DOC = Path(__file__).resolve().parents[2] / "docs" / "python_api.md"
CHUNKS = ["Refunds are issued within 14 days of purchase.", "Gift cards cannot be refunded."]
QUESTION = "Can I return a gift card?"


def _system(day: int) -> str:
    return (
        f"You are the support assistant of ACME Books. Today is 2026-12-{day:02d}. Rules: "
        "answer only from the context. If the context does not contain the answer, say you do "
        "not know."
    )


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_path())


def _fifth_prompt(tokenizer, **kwargs) -> ragkv.Answer:
    pipe = ragkv.Pipeline(SimulatedEngine(tokenizer, 50_000), **kwargs)
    for day in range(1, 6):
        answer = pipe.answer(QUESTION, CHUNKS, system=_system(day), params=SamplingParams(1))
    return answer


def test_the_documented_before_and_after_is_what_the_pipeline_sends(tokenizer):
    section = DOC.read_text().split("What the model reads, before and after", 1)[1]
    block = re.search(r"```text\n(.*?)```", section, flags=re.S).group(1)
    before, after = re.split(r"\nPipeline\(engine\) \(default\):[^\n]*\n", block)
    before = before.split("\n", 1)[1]  # drop the caption line
    assert _fifth_prompt(tokenizer, learn_system=False).prompt_text == before
    learned = _fifth_prompt(tokenizer)
    assert learned.prompt_text == after
    assert learned.plan.stats.demoted == ("system",)
    # Put back in the app's order, the moved sentence and what stayed are the app's text.
    stayed, moved = "You are the support assistant of ACME Books.", " Today is 2026-12-05."
    assert stayed + moved + after.split(stayed, 1)[1].split("\n\n", 1)[0] == _system(5)
    assert learned.prompt_text.endswith(
        moved + "<|im_end|>\n<|im_start|>user\n" + QUESTION + "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_prompt_text_is_the_decoded_prompt(tokenizer):
    answer = _fifth_prompt(tokenizer)
    assert answer.prompt_text == tokenizer.decode(answer.output.prompt_token_ids)


def test_learn_system_false_with_an_own_assembler_says_what_to_do(tokenizer):
    engine = SimulatedEngine(tokenizer, 4096)
    with pytest.raises(ConfigError, match="demote_invalidators=False") as info:
        ragkv.Pipeline(engine, assembler=Assembler(tokenizer), learn_system=False)
    assert info.value.param == "learn_system"
    kept = Assembler(tokenizer, demote_invalidators=False)
    assert ragkv.Pipeline(engine, assembler=kept, learn_system=False).assembler is kept
