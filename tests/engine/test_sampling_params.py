"""SamplingParams: validation at construction (RequestError, one line naming the value) and normalisation."""

from __future__ import annotations

import dataclasses
import math

import pytest

from kvfit.sampling_params import SamplingParams
from kvfit.errors import KvfitError, RequestError


def test_defaults():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.max_tokens) == (1.0, 1.0, -1, None, 16)
    assert p.stop == () and p.stop_token_ids == () and not p.ignore_eos and not p.greedy
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=0.0).greedy


def test_request_error_is_a_user_facing_value_error():
    assert issubclass(RequestError, KvfitError) and issubclass(RequestError, ValueError)


def test_params_are_frozen():
    p = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.01), r"temperature must be in \[0, 2\]"),
    (dict(temperature=2.01), r"temperature must be in \[0, 2\]"),
    (dict(temperature=-1), "temperature"),
    (dict(temperature="1"), "temperature"),
    (dict(top_p=0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=-0.5), "top_p"),
    (dict(top_p=1.0000001), "top_p"),
    (dict(top_p=2), "top_p"),
    (dict(top_p=math.nan), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=-100), "top_k"),
    (dict(top_k=2.0), "top_k"),
    (dict(top_k=True), "top_k"),
    (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(max_tokens=2.0), "max_tokens"),
    (dict(max_tokens="8"), "max_tokens"),
    (dict(seed=1.0), "seed must be an integer"),
    (dict(seed="7"), "seed"),
    (dict(seed=True), "seed"),
    (dict(stop=""), "stop strings must be non-empty"),
    (dict(stop=("ok", "")), "stop strings"),
    (dict(stop=[""]), "stop strings"),
    (dict(stop=5), "stop must be a string or a list of strings"),
    (dict(top_k=2**62), "below 2\\*\\*31"),
    (dict(stop_token_ids=5), "stop_token_ids must be a list"),
])
def test_invalid_values_raise_request_error(kwargs, match):
    with pytest.raises(RequestError, match=match) as info:
        SamplingParams(**kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0), dict(temperature=0.7), dict(temperature=2),
    dict(top_p=1), dict(top_p=1e-9), dict(top_p=0.5),
    dict(top_k=-1), dict(top_k=0), dict(top_k=1), dict(top_k=50),
    dict(max_tokens=None), dict(max_tokens=1), dict(max_tokens=10_000),
    dict(seed=None), dict(seed=0), dict(seed=-5), dict(seed=2**70),
    dict(ignore_eos=True),
])
def test_valid_values_are_accepted(kwargs):
    p = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        assert getattr(p, name) == value


def test_a_stop_string_becomes_a_one_element_tuple():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop="\n").stop == ("\n",)


def test_stop_sequences_and_stop_token_ids_become_tuples():
    p = SamplingParams(stop=["a", "bc"], stop_token_ids=[3, 4])
    assert p.stop == ("a", "bc") and p.stop_token_ids == (3, 4)
    assert SamplingParams(stop=None, stop_token_ids=None).stop == ()
    assert SamplingParams(stop=None, stop_token_ids=None).stop_token_ids == ()
    # tuples make params hashable and comparable by value
    assert SamplingParams(stop=["x"]) == SamplingParams(stop=("x",))
    assert hash(SamplingParams(stop=["x"], stop_token_ids=[1])) == hash(SamplingParams(stop="x", stop_token_ids=(1,)))


@pytest.mark.parametrize("temperature", [math.nan, math.inf])
def test_non_finite_temperature_is_rejected(temperature):
    with pytest.raises(RequestError, match="temperature"):
        SamplingParams(temperature=temperature)


def test_bool_max_tokens_is_rejected():
    with pytest.raises(RequestError, match="max_tokens"):
        SamplingParams(max_tokens=True)


@pytest.mark.parametrize("kwargs", [dict(temperature=1e-40), dict(stop=["a", 3]), dict(stop_token_ids=["x"]),
                                    dict(stop_token_ids=[-1])])
def test_values_the_sampler_cannot_use_are_rejected_up_front(kwargs):
    with pytest.raises(RequestError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, param", [
    (dict(n=0), "n"), (dict(n=1.0), "n"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(presence_penalty=math.nan), "presence_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(min_p=1.5), "min_p"), (dict(min_p=-0.1), "min_p"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    (dict(logprobs=-2), "logprobs"), (dict(logprobs=2.0), "logprobs"), (dict(prompt_logprobs=1.5), "prompt_logprobs"),
    (dict(logit_bias=[1, 2]), "logit_bias"), (dict(logit_bias={"a": 1.0}), "logit_bias"),
    (dict(logit_bias={3: math.inf}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
    (dict(bad_words="word"), "bad_words"), (dict(bad_words=["ok", " "]), "bad_words"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output"), (dict(detokenize=None), "detokenize"),
    (dict(skip_special_tokens="no"), "skip_special_tokens"),
    (dict(stop=["x"], detokenize=False), "stop"),
    (dict(structured_outputs={"regex": "a"}), "structured_outputs"),
])
def test_new_fields_are_validated_naming_the_param(kwargs, param):
    with pytest.raises(RequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param and "\n" not in str(info.value)


def test_logit_bias_keys_from_json_and_clamping():
    p = SamplingParams(logit_bias={"5": 250, 7: -1000.0, 9: 0.5})
    assert p.logit_bias == {5: 100.0, 7: -100.0, 9: 0.5}


def test_for_sample_gives_seed_plus_index():
    p = SamplingParams(n=3, seed=10, logprobs=2)
    assert [p.for_sample(i).seed for i in range(3)] == [10, 11, 12]
    assert p.for_sample(1).n == 1 and p.for_sample(1).logprobs == 2
    assert SamplingParams(n=2).for_sample(1).seed is None


def test_admission_checks_token_ids_against_the_vocab():
    from kvfit.engine.admission import bad_words_token_ids, check_request
    for kwargs, param in ((dict(logit_bias={100: 1.0}), "logit_bias"), (dict(allowed_token_ids=[3, 100]),
                                                                        "allowed_token_ids"),
                          (dict(stop_token_ids=[100]), "stop_token_ids")):
        with pytest.raises(RequestError) as info:
            check_request([1, 2], SamplingParams(**kwargs), 100, 64, 4, 100)
        assert info.value.param == param and "100" in str(info.value)
    # vLLM's rule: the word alone, and with a leading space when that is a new first token of the same length
    encode = {"bad": [7], " bad": [8], "two words": [3, 4], " two words": [5, 4, 9]}.__getitem__
    assert bad_words_token_ids(("bad", "two words"), encode, 100) == ((7,), (8,), (3, 4))


def test_admission_checks_prompt_token_types_and_range():
    import enum
    from kvfit.engine.admission import are_token_ids, check_request

    class Tok(enum.IntEnum):
        A = 5
    assert are_token_ids([1, 2, 3]) and are_token_ids([]) and are_token_ids([1, Tok.A])    # int subclasses: slow path
    assert not are_token_ids([1, True]) and not are_token_ids([1, 2.0]) and not are_token_ids(["1"])
    for prompt, message in (([1, False], "list of integers"), ([1, 99, 100], r"\[0, 100\)"), ([-1, 2], r"\[0, 100\)")):
        with pytest.raises(RequestError, match=message) as info:
            check_request(prompt, SamplingParams(), 100, 64, 4, 100)
        assert info.value.param == "prompt"
    assert check_request([0, 99, Tok.A], SamplingParams(max_tokens=4), 100, 64, 4, 100) == 7


def test_admission_checks_logprobs_against_max_logprobs():
    # vLLM's --max-logprobs (default 20) is the engine's: a SamplingParams may ask for more, admission refuses it
    from kvfit.engine.admission import check_request
    for name in ("logprobs", "prompt_logprobs"):
        params = SamplingParams(**{name: 21})
        with pytest.raises(RequestError, match="--max-logprobs of 20") as info:
            check_request([1, 2], params, 100, 64, 4, 100)
        assert info.value.param == name
        assert check_request([1, 2], params, 100, 64, 4, 100, max_logprobs=21) == 2 + 16     # max_tokens 16
    assert check_request([1, 2], SamplingParams(logprobs=20, prompt_logprobs=20), 100, 64, 4, 100) == 18


def test_vllm_readings_of_seed_minus_one_and_logprobs_true():
    """As vLLM's SamplingParams: seed -1 is no seed (a random draw each call), logprobs / prompt_logprobs True are 1."""
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2
    p = SamplingParams(logprobs=True, prompt_logprobs=True)
    assert p.logprobs == 1 and p.prompt_logprobs == 1 and type(p.logprobs) is int
