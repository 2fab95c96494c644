"""Issue 27 (low): offline-API misuses that raised raw exceptions are one clear KvfitError each, and a checkpoint
with NaN weights starts (its start-up profile samples NaN logits) and ends each request with finish reason
"error" instead of a traceback."""

from __future__ import annotations

import os

import pytest
from safetensors.torch import load_file, save_file

from kvfit import LLM, SamplingParams
from kvfit.errors import ConfigError, KvfitError, RequestError
from tiny_models import make_tiny_model

KW = dict(device="cpu", dtype="float32", max_model_len=64, kv_cache_memory="8MiB")
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, **KW)


@pytest.mark.parametrize("call, param", [
    (lambda llm: llm.engine.abort(5), "request_id"),
    (lambda llm: llm.engine.encode(None), "prompt"),
    (lambda llm: llm.chat(CHAT, chat_template_kwargs=[1]), "chat_template_kwargs"),
    (lambda llm: llm.chat(CHAT, chat_template_kwargs={"raise_exception": 1}), "chat_template_kwargs"),
    (lambda llm: llm.chat(CHAT, chat_template="{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"), None),
])
def test_misuse_is_one_request_error(llm, call, param):
    with pytest.raises(RequestError) as info:
        call(llm)
    assert "\n" not in str(info.value) and (param is None or info.value.param == param), info.value


def test_a_chat_template_that_is_not_text_is_a_config_error(llm):
    with pytest.raises(ConfigError, match="must be a Jinja template string, got int"):
        llm.chat(CHAT, chat_template=5)


def test_chat_template_kwargs_named_self_is_a_variable(llm):
    out = llm.chat(CHAT, SamplingParams(max_tokens=2), chat_template_kwargs={"self": 1}, use_tqdm=False)
    assert len(out) == 1 and out[0].outputs[0].finish_reason in ("length", "stop")


def test_a_checkpoint_with_nan_weights_starts_and_fails_each_request_alone(tmp_path):
    folder = make_tiny_model(tmp_path, arch="llama")
    path = os.path.join(folder, "model.safetensors")
    weights = load_file(path)
    for name, tensor in weights.items():
        if "embed_tokens" in name:
            tensor.fill_(float("nan"))
    save_file(weights, path, metadata={"format": "pt"})
    nan_llm = LLM(folder, **KW)          # the start-up profile runs on NaN logits
    try:
        out = nan_llm.generate([[5, 9, 23]], SamplingParams(max_tokens=3, top_p=0.9, temperature=1.0),
                               use_tqdm=False)[0]
        assert out.outputs[0].finish_reason == "error"
    except KvfitError as exc:            # a clear error is acceptable, a raw exception is not
        assert "\n" not in str(exc)
    finally:
        nan_llm.shutdown()


@pytest.mark.parametrize("key", ["²", "9" * 5000, "５", "-1", "1.5"])
def test_a_logit_bias_key_that_is_not_ascii_digits_is_a_request_error(key):
    with pytest.raises(RequestError) as info:        # "²" and 5,000 digits were raw ValueErrors, "５" was 5
        SamplingParams(logit_bias={key: 1.0})
    assert info.value.param == "logit_bias" and len(str(info.value)) < 200
    assert SamplingParams(logit_bias={" 12 ": 1.0}).logit_bias == {12: 1.0}
