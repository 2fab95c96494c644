"""--generation-config (vLLM's): the model's generation_config.json gives default sampling params.

A copy of the tiny llama whose generation_config.json sets temperature 0 (greedy), a repetition
penalty and max_new_tokens: requests (HTTP, and LLM.generate / LLM.chat without params) that leave a
field out get the file's value; an explicit field wins; `vllm` ignores the file; a folder given by
path is read instead and its max_new_tokens caps every request. The reference is the offline API
with the same params written out.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import openai
import pytest

from kvfit import LLM, SamplingParams
from kvfit.errors import ConfigError
from server_testing import ENGINE_KWARGS, make_engine, running_server

MODEL = "tiny"
PROMPT = "Hello, my name is"
PENALTY = 2.0
MAX_NEW_TOKENS = 6
FILE_DEFAULTS = {"temperature": 0.0, "repetition_penalty": PENALTY, "max_new_tokens": MAX_NEW_TOKENS}
# what the file means, vLLM's names (max_new_tokens is max_tokens)
PARAMS = dict(temperature=0.0, repetition_penalty=PENALTY)


def _write_generation_config(folder, fields: dict) -> None:
    with open(os.path.join(folder, "generation_config.json"), "w", encoding="utf-8") as fh:
        json.dump({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, **fields}, fh)


@pytest.fixture(scope="module")
def tuned_model(tiny_llama, tmp_path_factory):
    """The tiny llama with a generation_config.json that sets sampling defaults."""
    folder = str(tmp_path_factory.mktemp("tuned") / "model")
    shutil.copytree(tiny_llama, folder)
    _write_generation_config(folder, {**FILE_DEFAULTS, "top_k": 50, "do_sample": True})   # top_k 50: transformers'
    return folder


def _client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client_auto(tuned_model):
    engine = make_engine(tuned_model)
    try:
        with running_server(engine, MODEL) as (url, _):
            yield _client(url)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def client_vllm(tuned_model):
    engine = make_engine(tuned_model, generation_config="vllm")
    try:
        with running_server(engine, MODEL) as (url, _):
            yield _client(url)
    finally:
        engine.shutdown()


def offline_text(offline, **params) -> str:
    return offline.generate([PROMPT], SamplingParams(**params), use_tqdm=False)[0].outputs[0].text


def test_the_penalty_changes_greedy_output(offline):
    # the tests below tell the file's defaults apart from vLLM's only if this holds
    assert offline_text(offline, max_tokens=16, **PARAMS) != offline_text(offline, max_tokens=16, temperature=0.0)


def test_server_applies_the_file_to_fields_the_request_leaves_out(client_auto, offline):
    resp = client_auto.completions.create(model=MODEL, prompt=PROMPT)              # no temperature, no penalty
    assert resp.choices[0].text == offline_text(offline, max_tokens=16, **PARAMS)   # completions' own 16 stays
    chat = client_auto.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                               extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == MAX_NEW_TOKENS                            # chat: max_new_tokens


def test_an_explicit_request_field_wins(client_auto, offline):
    resp = client_auto.completions.create(model=MODEL, prompt=PROMPT, temperature=1.0, seed=3, max_tokens=8)
    # temperature is the request's; the penalty it left out is still the file's
    assert resp.choices[0].text == offline_text(offline, temperature=1.0, seed=3, max_tokens=8,
                                                repetition_penalty=PENALTY)
    resp = client_auto.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, extra_body={
        "repetition_penalty": 1.0})
    assert resp.choices[0].text == offline_text(offline, temperature=0.0, max_tokens=8)


def test_generation_config_vllm_ignores_the_file(client_vllm, offline):
    resp = client_vllm.completions.create(model=MODEL, prompt=PROMPT, seed=3, max_tokens=8)
    assert resp.choices[0].text == offline_text(offline, seed=3, max_tokens=8)       # temperature 1, no penalty
    greedy = client_vllm.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=16)
    assert greedy.choices[0].text == offline_text(offline, temperature=0.0, max_tokens=16)


def test_offline_defaults_and_generate_without_params(tuned_model, offline, caplog):
    caplog.set_level(logging.INFO, logger="kvfit")
    llm = LLM(tuned_model, **ENGINE_KWARGS)
    try:
        assert llm.get_default_sampling_params() == SamplingParams(max_tokens=MAX_NEW_TOKENS, **PARAMS)
        out = llm.generate([PROMPT], use_tqdm=False)[0].outputs[0]
        assert out.text == offline_text(offline, max_tokens=MAX_NEW_TOKENS, **PARAMS)
        chat = llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)[0].outputs[0]
        assert len(chat.token_ids) <= MAX_NEW_TOKENS
    finally:
        llm.shutdown()
    lines = [r.getMessage() for r in caplog.records if "default sampling params" in r.getMessage()]
    assert len(lines) == 1 and "generation_config.json" in lines[0] and f"repetition_penalty={PENALTY}" in lines[0]
    assert "top_k" not in lines[0]                     # 50 is transformers' default: not a default of the file's
    llm = LLM(tuned_model, generation_config="vllm", **ENGINE_KWARGS)
    try:
        assert llm.get_default_sampling_params() == SamplingParams()
    finally:
        llm.shutdown()


def test_a_folder_given_by_path_is_read_and_its_max_new_tokens_caps_requests(tiny_llama, tmp_path):
    _write_generation_config(tmp_path, {"max_new_tokens": 3})
    engine = make_engine(tiny_llama, generation_config=str(tmp_path))
    try:
        with running_server(engine, MODEL) as (url, _):
            resp = _client(url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0,
                                                   extra_body={"ignore_eos": True})
    finally:
        engine.shutdown()
    assert resp.usage.completion_tokens == 3                   # vLLM's override_max_tokens: min(10, 3)


@pytest.mark.parametrize("fields, expected", [
    ({"temperature": "hot"}, "'temperature' must be a finite number >= 0, got 'hot'"),
    ({"top_k": 2.5}, "'top_k' must be an integer >= -1"),
    ({"max_new_tokens": 0}, "'max_new_tokens' must be a positive integer"),
    ({"top_p": 2.0}, "top_p"),
])
def test_a_bad_field_is_a_one_line_error_naming_the_file(tiny_llama, tmp_path, fields, expected):
    _write_generation_config(tmp_path, fields)
    with pytest.raises(ConfigError) as info:
        make_engine(tiny_llama, generation_config=str(tmp_path))
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(tmp_path / "generation_config.json")), message
    assert expected in message, message


def test_a_bad_generation_config_setting(tiny_llama, tmp_path):
    from kvfit.config import EngineConfig
    with pytest.raises(ConfigError, match="--generation-config must be auto, vllm or a folder"):
        EngineConfig.from_kwargs(tiny_llama, generation_config=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="that folder has no generation_config.json"):
        make_engine(tiny_llama, generation_config=str(tmp_path))
