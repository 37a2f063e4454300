import pytest

from ragkv.cache_engine.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS, SamplingParams
from ragkv.errors import InvalidInputError


def test_default_is_greedy_and_valid():
    params = SamplingParams()
    params.validate(vocab_size=100)
    assert params.greedy
    assert params.temperature == 0.0
    assert not SamplingParams(temperature=0.7).greedy


def test_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_stop_lists_are_copied_not_shared():
    stops = ["x"]
    params = SamplingParams(stop=stops)
    stops.append("y")
    assert params.stop == ["x"]


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"seed": "7"}, "seed"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": [3]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": [-1]}, "stop token id"),
        ({"stop_token_ids": [100]}, "stop token id"),
        ({"stop_token_ids": ["2"]}, "stop_token_ids"),
    ],
)
def test_invalid_settings_raise_invalid_input_naming_the_setting(kwargs, names):
    with pytest.raises(InvalidInputError, match=names):
        SamplingParams(**kwargs).validate(vocab_size=100)


def test_stop_token_ids_are_only_range_checked_against_a_known_vocab():
    SamplingParams(stop_token_ids=[10_000]).validate()
    with pytest.raises(InvalidInputError, match=r"\[0, 50\)"):
        SamplingParams(stop_token_ids=[10_000]).validate(vocab_size=50)


def test_edge_values_are_accepted():
    SamplingParams(
        max_tokens=1, temperature=2.0, top_k=-1, top_p=1.0, min_p=1.0, logprobs=20, seed=0
    ).validate(vocab_size=100)
    SamplingParams(top_k=0, logprobs=0, stop_token_ids=[99]).validate(vocab_size=100)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_p": 2.0}, "top_p"),
        ({"min_p": 2.0}, "min_p"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.0}, "seed"),
        ({"logprobs": 99}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["a"] * 5}, "stop"),
        ({"stop": ["x" * 257]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": ["2"]}, "stop_token_ids"),
        ({"stop_token_ids": 3}, "stop_token_ids"),
    ],
)
def test_invalid_settings_fail_at_construction_with_param_naming_the_field(kwargs, param):
    with pytest.raises(InvalidInputError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert param in str(info.value)


def test_vocab_bound_on_stop_token_ids_names_the_field():
    with pytest.raises(InvalidInputError, match="stop_token_ids") as info:
        SamplingParams(stop_token_ids=[100]).validate(vocab_size=100)
    assert info.value.param == "stop_token_ids"


def test_seed_accepts_the_whole_unsigned_64_bit_range():
    SamplingParams(seed=0, temperature=1.0)
    SamplingParams(seed=2**64 - 1, temperature=1.0)


def test_stop_caps_accept_their_limits():
    params = SamplingParams(stop=["a" * MAX_STOP_CHARS, "b", "c", "d"])
    assert len(params.stop) == MAX_STOP_STRINGS == 4


def test_openai_mapping_round_trips():
    body = {"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 3, "min_p": 0.1}
    body |= {"seed": 11, "stop": ["\n"], "stop_token_ids": [2], "ignore_eos": True}
    body |= {"include_stop_str_in_output": True, "skip_special_tokens": False}
    params = SamplingParams.from_openai(body)
    assert params.to_openai() == body
    assert SamplingParams.from_openai(params.to_openai()) == params


def test_openai_body_defaults_and_only_set_extensions_go_out():
    params = SamplingParams.from_openai({"max_completion_tokens": 5, "max_tokens": 9})
    assert params.max_tokens == 5 and params.temperature == 1.0  # OpenAI's default
    assert set(SamplingParams().to_openai()) == {"max_tokens", "temperature", "top_p"}


def test_openai_negative_seed_is_its_twos_complement():
    assert SamplingParams.from_openai({"seed": -1}).seed == 2**64 - 1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"seed": 2**63}, "seed"),
        ({"stop": [1]}, "stop"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"max_tokens": 1.5}, "max_tokens"),
    ],
)
def test_openai_body_errors_name_their_field(body, param):
    with pytest.raises(InvalidInputError) as info:
        SamplingParams.from_openai(body)
    assert info.value.param == param
