"""Chat-template splicing and how far token-level assembly is from tokenizing the text."""

from __future__ import annotations

import pydoc_data.topics

import pytest

from ragkv.assembler import Assembler, SegmentKind
from ragkv.assembler.template import Layout, render_chat, render_plain
from ragkv.errors import ConfigError, InvalidInputError

_TEXT = " ".join(list(pydoc_data.topics.topics.values())[30:40])
CHUNKS = [_TEXT[i : i + 800] for i in range(0, 8000, 800)]  # windows cut mid-word
HISTORY = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
SYSTEM = "You are a helpful assistant."


def test_spliced_prompt_is_the_rendered_chat_template(any_tokenizer):
    asm = Assembler(any_tokenizer, order="retrieval")
    plan = asm.assemble(system=SYSTEM, chunks=CHUNKS[:3], question="Why?", history=HISTORY)
    system = SYSTEM + "\n\nContext:\n" + "\n\n".join(CHUNKS[:3])
    messages = [
        {"role": "system", "content": system},
        *HISTORY,
        {"role": "user", "content": "Why?"},
    ]
    expected = any_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert plan.text == expected
    assert asm.decode(plan.token_ids) == expected


def test_plain_layout_without_a_chat_template(plain_tokenizer):
    asm = Assembler(plain_tokenizer, order="retrieval")
    plan = asm.assemble(system=SYSTEM, chunks=CHUNKS[:2], question="Why?", history=HISTORY)
    expected = (
        f"{SYSTEM}\n\nContext:\n{CHUNKS[0]}\n\n{CHUNKS[1]}\n\nUser: hi\n\nAssistant: hello there"
        "\n\nQuestion: Why?\nAnswer:"
    )
    assert plan.text == expected
    assert asm.decode(plan.token_ids) == expected


def test_seam_mismatch_is_measured_and_bounded_by_the_seams(any_tokenizer):
    asm = Assembler(any_tokenizer, measure_seams=True)
    plan = asm.assemble(system=SYSTEM, chunks=CHUNKS, question="Why?", history=HISTORY)
    reference = asm.tokenizer.encode(plan.text)
    assert plan.stats.token_count_delta == len(plan) - len(reference)
    # Tokenization differs only around the ~2 seams per segment, never inside a segment.
    assert 0 <= plan.stats.seam_mismatch_tokens <= 4 * len(plan.segments)
    assert asm.decode(plan.token_ids) == plan.text
    assert Assembler(any_tokenizer).assemble(question="q").stats.seam_mismatch_tokens is None


def test_template_pieces_are_tokenized_once_per_conversation_shape(local_tokenizer):
    asm = Assembler(local_tokenizer)
    asm.assemble(system=SYSTEM, chunks=CHUNKS[:2], question="first", history=HISTORY)
    calls: list[str] = []
    encode = asm.tokenizer.encode
    asm.tokenizer.encode = lambda text: calls.append(text) or encode(text)  # type: ignore[method-assign]
    asm.assemble(system=SYSTEM, chunks=CHUNKS[:2], question="second", history=HISTORY)
    assert calls == ["hi", "hello there", "second"]  # only the volatile segments


def test_chat_template_that_drops_content_is_a_config_error(bpe):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, chat_template="{{ messages[-1]['content'] }}"
    )
    with pytest.raises(ConfigError, match="chat_template=False"):
        Assembler(tok).assemble(system=SYSTEM, question="q")
    plan = Assembler(tok, chat_template=False).assemble(system=SYSTEM, question="q")
    assert plan.text == f"{SYSTEM}\n\nQuestion: q\nAnswer:"


def test_bad_inputs_are_rejected_with_invalid_input_errors(local_tokenizer):
    asm = Assembler(local_tokenizer)
    with pytest.raises(InvalidInputError):
        asm.assemble(question=None)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="history"):
        asm.assemble(question="q", history=[{"role": "user"}])
    with pytest.raises(InvalidInputError, match="cannot be overridden"):
        asm.assemble(question="q", stability={"question": "static"})
    with pytest.raises(InvalidInputError):
        asm.assemble(question="q", chunks=[42])  # type: ignore[list-item]
    assert asm.assemble(question="q").spans(SegmentKind.QUESTION)[0].end > 0


def test_one_plain_fallback_for_tokenizers_without_a_chat_template():
    class NoTemplate:
        chat_template = None

    layout = Layout()
    with_system = [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]
    assert render_chat(NoTemplate(), with_system) == "S\n\nQuestion: q\nAnswer:"
    turns = [{"role": "user", "content": "hi"}, {"role": "user", "content": "q"}]
    assert render_plain(turns, layout) == "User: hi\n\nQuestion: q\nAnswer:"


def test_placeholders_split_in_one_pass_and_only_when_each_appears_once_in_order():
    from ragkv.assembler.template import _holder, split_at_holders

    text = "A" + _holder(0) + "B" + _holder(1) + "C"
    assert split_at_holders(text, 2) == ["A", "B", "C"]
    assert split_at_holders(text + _holder(1), 2) is None  # a content rendered twice
    assert split_at_holders("A" + _holder(1) + "B" + _holder(0), 2) is None  # reordered
    assert split_at_holders("A" + _holder(0), 2) is None  # one dropped
    many = "".join(f"<{i}>" + _holder(i) for i in range(5000)) + "end"
    assert split_at_holders(many, 5000)[-1] == "end"  # linear: thousands of turns at once
