"""Which ids end a request, as vLLM 0.26 gathers them (its SamplingParams.update_from_generation_config): the
tokenizer's eos_token first, then generation_config.json's eos_token_id (else config.json's) as stop token ids
(their stop gives stop_reason); min_tokens holds every one of them back, ignore_eos or not."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from kvfit import LLM, SamplingParams
from tiny_models import make_tiny_model

PROMPT = [1, 40, 41, 42]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("eos"), arch="llama")


def _folder(source, tmp_path, generation_eos, tokenizer_eos: str) -> str:
    folder = str(tmp_path / "model")
    shutil.copytree(source, folder)
    with open(os.path.join(folder, "generation_config.json"), "w") as fh:
        json.dump({"bos_token_id": 1, "pad_token_id": 0} |
                  ({} if generation_eos is None else {"eos_token_id": generation_eos}), fh)
    if generation_eos is None:
        with open(os.path.join(folder, "config.json")) as fh:
            config = json.load(fh)
        config.pop("eos_token_id", None)
        with open(os.path.join(folder, "config.json"), "w") as fh:
            json.dump(config, fh)
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path) as fh:
        config = json.load(fh)
    config["eos_token"] = tokenizer_eos
    with open(path, "w") as fh:
        json.dump(config, fh)
    return folder


def _one(llm, **params):
    return llm.generate([PROMPT], SamplingParams(temperature=0, **params), use_tqdm=False)[0].outputs[0]


def test_the_tokenizers_eos_ends_a_request_the_configs_do_not_name(source, tmp_path):
    # no eos_token_id in generation_config.json or config.json: the tokenizer's </s> (2) still ends it
    llm = LLM(_folder(source, tmp_path, None, "</s>"), dtype="float32", kv_cache_memory="16MiB", max_model_len=64)
    assert llm.engine.eos_token_ids == (2,)
    out = _one(llm, max_tokens=4, logit_bias={2: 100})
    assert (list(out.token_ids), out.finish_reason, out.stop_reason) == ([2], "stop", None)
    llm.shutdown()


def test_generation_configs_other_eos_ids_stop_with_their_id_as_stop_reason(source, tmp_path):
    # the tokenizer's eos is <unk> (0); generation_config.json names 2 and 7
    llm = LLM(_folder(source, tmp_path, [2, 7], "<unk>"), dtype="float32", kv_cache_memory="16MiB",
              max_model_len=64)
    assert llm.engine.eos_token_ids == (0, 2, 7)
    for token, reason in ((0, None), (2, 2), (7, 7)):
        out = _one(llm, max_tokens=4, logit_bias={token: 100})
        assert (list(out.token_ids), out.finish_reason, out.stop_reason) == ([token], "stop", reason)
    # min_tokens holds them all back, with ignore_eos too (vLLM's _all_stop_token_ids)
    for ignore_eos in (False, True):
        out = _one(llm, max_tokens=5, min_tokens=3, ignore_eos=ignore_eos, logit_bias={0: 100, 2: 100, 7: 100})
        assert not {0, 2, 7} & set(out.token_ids[:3]), (ignore_eos, out.token_ids)
        assert len(out.token_ids) == (5 if ignore_eos else 4)
    llm.shutdown()
