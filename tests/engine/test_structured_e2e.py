"""Structured outputs through the engine on a tiny random Llama: a regex, a JSON-schema enum and a choice
are always obeyed (the grammar's bitmask is applied before the draw), a terminated grammar ends the request
with finish reason "stop", a bad grammar is a RequestError at admission, and multi-step engines run such
requests in single steps."""

from __future__ import annotations

import json
import re

import pytest

from kvfit import LLM, SamplingParams
from kvfit.errors import RequestError
from kvfit.structured_params import StructuredOutputsParams

pytest.importorskip("llguidance")

KW = dict(device="cpu", dtype="float32", block_size=4, max_model_len=96, kv_cache_memory="8MiB")
PROMPTS = [[5, 9, 23], [40, 41, 42, 43, 44]]
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "blue", "green"]}}, "required": ["color"],
          "additionalProperties": False}


@pytest.fixture(scope="module", params=[1, 4], ids=["single_step", "multi_step"])
def llm(tiny_llama, request):
    return LLM(tiny_llama, num_scheduler_steps=request.param, **KW)


def _run(llm, spec, seeds=(1, 2, 3)):
    params = [SamplingParams(max_tokens=40, seed=s, structured_outputs=spec) for s in seeds]
    # a plain request rides along in the same batch, unconstrained
    outs = llm.generate(PROMPTS * len(seeds) + [[7, 8]], params * 2 + [SamplingParams(max_tokens=8, seed=0)],
                        use_tqdm=False)
    return [o.outputs[0] for o in outs[:-1]]


def test_regex_is_always_obeyed(llm):
    for sample in _run(llm, StructuredOutputsParams(regex=r"[0-9]{3}-[a-c]{1,4}")):
        assert re.fullmatch(r"[0-9]{3}-[a-c]{1,4}", sample.text), sample.text
        assert sample.finish_reason == "stop"


def test_json_schema_enum_is_always_obeyed(llm):
    for sample in _run(llm, StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)):
        assert json.loads(sample.text)["color"] in ("red", "blue", "green"), sample.text
        assert sample.finish_reason == "stop"


def test_choice_and_n(llm):
    out = llm.generate(PROMPTS[:1], SamplingParams(n=3, seed=4, max_tokens=10,
                                                   structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
                       use_tqdm=False)[0]
    assert [s.index for s in out.outputs] == [0, 1, 2]
    assert all(s.text in ("yes", "no") and s.finish_reason == "stop" for s in out.outputs)


def test_a_bad_grammar_is_a_request_error(llm):
    with pytest.raises(RequestError) as info:
        llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed")),
                     use_tqdm=False)
    assert info.value.param == "structured_outputs" and "\n" not in str(info.value)
    assert not llm.engine.has_unfinished()
