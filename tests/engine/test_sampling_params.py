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
    (dict(temperature=-0.01), "temperature must be >= 0"),
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
