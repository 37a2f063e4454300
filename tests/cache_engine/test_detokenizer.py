import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from ragkv.cache_engine.detokenizer import (
    PROMPT_CONTEXT_TOKENS,
    IncrementalDetokenizer,
    StopMatcher,
)
from ragkv.cache_engine.sampling_params import SamplingParams

CORPUS = [
    "Retrieval augmented generation pastes retrieved chunks in front of the question. ",
    "The quick brown fox jumps over the lazy dog, again and again, until the cache is warm. ",
    "Prefix caching reuses the key and value blocks of a prompt that was already seen. ",
    "检索增强生成把检索到的文本块放在问题前面。缓存命中可以节省计算。",
    "絵文字も使います 😀🎉🚀 and café naïve résumé. Numbers 0123456789 and symbols !?;:()[]{}.",
    "User: what is the answer?\nAssistant: The answer is 42.\n\n",
] * 20
SPECIAL = "<|endoftext|>"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte (the byte-level BPE alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_CHAR = _bytes_to_unicode()


def _train(pre_tokenizer, decoder, alphabet) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoder
    trainer = trainers.BpeTrainer(
        vocab_size=700, special_tokens=[SPECIAL], initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=SPECIAL, clean_up_tokenization_spaces=False
    )


@pytest.fixture(scope="module")
def byte_bpe() -> PreTrainedTokenizerFast:
    """GPT-2 style byte-level BPE ("Ġ" marks a leading space), trained here on a few KB."""
    return _train(
        pre_tokenizers.ByteLevel(add_prefix_space=False),
        decoders.ByteLevel(),
        pre_tokenizers.ByteLevel.alphabet(),
    )


@pytest.fixture(scope="module")
def sentencepiece_bpe() -> PreTrainedTokenizerFast:
    """SentencePiece style ("▁" marks a space, stripped at the start of a decoded text)."""
    return _train(
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first"),
        decoders.Metaspace(replacement="▁", prepend_scheme="first"),
        [],
    )


def _byte_ids(tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte, so every multi-byte character is split across tokens."""
    return [tokenizer.convert_tokens_to_ids(BYTE_CHAR[b]) for b in text.encode()]


def _stream(tokenizer, ids, params=None, prompt=()):
    params = params or SamplingParams(max_tokens=10_000, ignore_eos=True)
    detok = IncrementalDetokenizer(tokenizer, list(prompt), params)
    deltas = []
    for token_id in ids:
        deltas.append(detok.add(token_id))
        if detok.finished:
            break
    deltas.append(detok.flush())
    return detok, deltas


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_streamed_deltas_concatenate_to_the_full_decode(byte_bpe, data):
    vocab = len(byte_bpe)
    ids = data.draw(st.lists(st.integers(0, vocab - 1), max_size=40))
    prompt = byte_bpe.encode("Question: what is cached?\n")
    detok, deltas = _stream(byte_bpe, ids, prompt=prompt)
    expected = byte_bpe.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) == expected
    assert detok.text == expected
    if "\ufffd" not in expected:
        assert not any("\ufffd" in d for d in deltas)


def test_multibyte_characters_split_across_tokens_are_emitted_whole(byte_bpe):
    ids = _byte_ids(byte_bpe, "😀中")
    _, deltas = _stream(byte_bpe, ids)
    assert deltas == ["", "", "", "😀", "", "", "中", ""]


def test_incomplete_tail_is_flushed_as_the_tokenizer_decodes_it(byte_bpe):
    ids = _byte_ids(byte_bpe, "ok😀")[:-2]  # the emoji's last two bytes never come
    detok, deltas = _stream(byte_bpe, ids, SamplingParams(max_tokens=len(ids)))
    assert detok.finish_reason == "length"
    assert "".join(deltas) == byte_bpe.decode(ids) == "ok\ufffd"
    assert deltas[-1] == ""  # the max_tokens step already released the tail


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_sentencepiece_leading_spaces_survive_streaming(sentencepiece_bpe, data):
    words = st.sampled_from(["the", "cache", "answer", "检索", "42", "fox", "."])
    prompt_text = " ".join(data.draw(st.lists(words, min_size=1, max_size=5)))
    output_text = " ".join(data.draw(st.lists(words, min_size=1, max_size=8)))
    prompt = sentencepiece_bpe.encode(prompt_text)
    # Tokens a model would generate: the output as a continuation of the prompt.
    ids = sentencepiece_bpe.encode(prompt_text + " " + output_text)[len(prompt) :]
    _, deltas = _stream(sentencepiece_bpe, ids, prompt=prompt)
    full = sentencepiece_bpe.decode(prompt + ids)
    prompt_decoded = sentencepiece_bpe.decode(prompt)
    assert full.startswith(prompt_decoded)
    assert "".join(deltas) == full[len(prompt_decoded) :]
    assert "".join(deltas).startswith(" ")  # decoding the output alone would drop this space


def test_stop_string_spanning_tokens_is_cut_from_the_text(byte_bpe):
    ids = _byte_ids(byte_bpe, "The answer is 42.\n\nUser: and now?")
    params = SamplingParams(max_tokens=100, stop=["\n\nUser:"])
    detok, deltas = _stream(byte_bpe, ids, params)
    assert "".join(deltas) == detok.text == "The answer is 42."
    assert (detok.finish_reason, detok.stop_reason) == ("stop", "\n\nUser:")
    assert len(detok.output_token_ids) == len("The answer is 42.\n\nUser:")


def test_stop_string_is_kept_when_asked(byte_bpe):
    ids = byte_bpe.encode("The answer is 42.\n\nUser: and now?")
    params = SamplingParams(stop="User:", include_stop_str_in_output=True, max_tokens=100)
    detok, deltas = _stream(byte_bpe, ids, params)
    assert "".join(deltas) == detok.text == "The answer is 42.\n\nUser:"


def _first_completed_stop(text: str, stops: list[str]) -> str:
    """Text up to the stop string that completes first (earliest start among ties)."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if end >= len(s) and text[end - len(s) : end] == s]
        if starts:
            return text[: min(starts)]
    return text


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    text=st.text(alphabet="ab\n", max_size=30),
    stops=st.lists(st.text(alphabet="ab\n", min_size=1, max_size=4), min_size=1, max_size=4),
)
def test_stop_strings_never_leak_into_streamed_deltas(byte_bpe, text, stops):
    final = _first_completed_stop(text, stops)
    detok = IncrementalDetokenizer(byte_bpe, [], SamplingParams(max_tokens=1000, stop=stops))
    streamed = ""
    for token_id in _byte_ids(byte_bpe, text):
        streamed += detok.add(token_id)
        assert final.startswith(streamed), "streamed text that the stop string later cut"
        if detok.finished:
            break
    streamed += detok.flush()
    assert streamed == detok.text == final
    assert detok.finished
    if final != text:
        assert detok.finish_reason == "stop" and detok.stop_reason in stops


def test_held_back_text_is_at_most_the_longest_stop_minus_one(byte_bpe):
    detok = IncrementalDetokenizer(byte_bpe, [], SamplingParams(stop=["STOP", "xy"]))
    streamed = "".join(detok.add(t) for t in _byte_ids(byte_bpe, "abcdef"))
    assert streamed == "abc"
    assert detok.flush() == "def"
    assert detok.text == "abcdef" and detok.finish_reason is None


def test_stop_token_ends_generation_without_its_text(byte_bpe):
    stop_id = byte_bpe.convert_tokens_to_ids("!")
    ids = _byte_ids(byte_bpe, "hi!more")
    detok, deltas = _stream(byte_bpe, ids, SamplingParams(stop_token_ids=[stop_id]))
    assert "".join(deltas) == "hi"
    assert (detok.finish_reason, detok.stop_reason) == ("stop", stop_id)
    kept, deltas = _stream(
        byte_bpe, ids, SamplingParams(stop_token_ids=[stop_id], include_stop_str_in_output=True)
    )
    assert "".join(deltas) == kept.text == "hi!"


def test_eos_stops_unless_ignored(byte_bpe):
    eos = byte_bpe.eos_token_id
    ids = [*_byte_ids(byte_bpe, "done"), eos, *_byte_ids(byte_bpe, "extra")]
    detok, deltas = _stream(byte_bpe, ids, SamplingParams(max_tokens=100))
    assert "".join(deltas) == "done"
    assert (detok.finish_reason, detok.stop_reason) == ("stop", None)
    detok, deltas = _stream(byte_bpe, ids, SamplingParams(max_tokens=100, ignore_eos=True))
    assert "".join(deltas) == "doneextra" and not detok.finish_reason


def test_max_tokens_finishes_with_length(byte_bpe):
    ids = _byte_ids(byte_bpe, "abcdef")
    detok, deltas = _stream(byte_bpe, ids, SamplingParams(max_tokens=4))
    assert "".join(deltas) == "abcd"
    assert detok.finish_reason == "length"
    assert detok.add(ids[0]) == ""  # tokens after the end are ignored
    assert detok.output_token_ids == ids[:4]


def test_each_step_decodes_a_small_window(byte_bpe):
    windows = []
    backend = byte_bpe.backend_tokenizer

    class Recording:
        eos_token_id = byte_bpe.eos_token_id

        class backend_tokenizer:  # noqa: N801 - stands in for the attribute
            @staticmethod
            def decode(ids, skip_special_tokens):
                windows.append(len(ids))
                return backend.decode(ids, skip_special_tokens=skip_special_tokens)

    text = "the quick brown fox jumps over the lazy dog 😀 中文 " * 20
    ids = byte_bpe.encode(text)
    prompt = byte_bpe.encode("a long prompt " * 50)
    detok, deltas = _stream(Recording, ids, prompt=prompt)
    assert "".join(deltas) == text
    assert max(windows) <= PROMPT_CONTEXT_TOKENS + 4  # never the whole prompt or output


def test_real_default_model_tokenizer_streams_exactly(shipped_tokenizer):
    tok = shipped_tokenizer  # GPT-2 style byte-level BPE, vocab 49152
    text = "Retrieval works: 检索增强 😀🎉 café — naïve. Ends here<|im_end|> never shown"
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    detok, deltas = _stream(tok, ids, SamplingParams(max_tokens=1000), prompt=prompt)
    assert detok.finish_reason == "stop"  # <|im_end|> is the model's EOS
    expected = tok.decode(ids[: len(detok.output_token_ids) - 1], skip_special_tokens=True)
    assert "".join(deltas) == detok.text == expected
    assert expected.endswith("Ends here")
    assert not any("\ufffd" in d for d in deltas)


def test_stop_matching_rescans_only_the_tail_that_can_hold_a_new_match():
    matcher = StopMatcher(["abc", "xy"])
    assert matcher.max_len == 3
    text = "xy" + "-" * 10 + "abc"
    # Searched up to 12 before "abc" arrived: a match must end past 12, so the scan starts at
    # 12 - 3 + 1 = 10 and the old "xy" at 0 is never looked at again.
    assert matcher.search(text, 12) == (12, "abc")
    assert matcher.search(text, 3) == (12, "abc")
    assert matcher.search(text, 0) == (0, "xy")
    assert matcher.search("ab", 0) is None
    assert StopMatcher([]).search("anything", 0) is None


def test_earliest_stop_wins_and_ties_go_to_the_first_listed():
    assert StopMatcher(["bc", "abcd"]).search("xxabcd", 0) == (2, "abcd")
    assert StopMatcher(["ab", "abc"]).search("xabc", 0) == (1, "ab")
    assert StopMatcher(["abc", "ab"]).search("xabc", 0) == (1, "abc")
    assert StopMatcher(["a.c", "(x"]).search("abc (x a.c", 0) == (4, "(x")  # literals
