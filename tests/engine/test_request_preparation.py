"""Issue 27 (5) and (10): a request's grammar compiles, and its bad words tokenize, off the engine thread; the
request waits (status PREPARING, vLLM's WAITING_FOR_FSM) while every other request keeps stepping. A grammar
the engine cannot compile, or one that goes past llguidance's run-time limits, ends its request with finish
reason "error" and says why in stop_reason."""

from __future__ import annotations

import threading
import time

import pytest

from kvfit import LLM, SamplingParams
from kvfit.engine.admission import MAX_BAD_WORDS
from kvfit.engine.request import RequestStatus
from kvfit.errors import RequestError
from kvfit.structured_params import StructuredOutputsParams

pytest.importorskip("llguidance")

KW = dict(device="cpu", dtype="float32", block_size=4, max_model_len=96, kv_cache_memory="8MiB")
SLOW_COMPILE_S = 1.5


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, **KW)


def _run_all(engine, timeout_s: float = 60.0) -> tuple[dict, float]:
    """Step until nothing is left; the finished outputs by id and the longest step in seconds."""
    done, longest, deadline = {}, 0.0, time.monotonic() + timeout_s
    while engine.has_unfinished():
        assert time.monotonic() < deadline, "requests did not finish"
        start = time.monotonic()
        for out in engine.step(stream=False):
            done[out.request_id] = out
        longest = max(longest, time.monotonic() - start)
    return done, longest


def test_a_slow_compile_leaves_other_requests_stepping(llm, monkeypatch):
    engine = llm.engine
    structured = engine._structured()
    build = structured._build

    def slow_build(spec):
        time.sleep(SLOW_COMPILE_S)
        return build(spec)
    monkeypatch.setattr(structured, "_build", slow_build)
    spec = StructuredOutputsParams(regex=r"[0-9]{2}-slow")
    engine.add_request([5, 9, 23], SamplingParams(max_tokens=20, seed=1, structured_outputs=spec), "grammar")
    engine.add_request([7, 8], SamplingParams(max_tokens=12, ignore_eos=True), "plain")
    assert engine.scheduler.requests["grammar"].status is RequestStatus.PREPARING
    assert engine.stats()["waiting"] >= 1 and engine.stats()["preparing"] == 1
    finished_first = None
    done, longest = {}, 0.0
    while engine.has_unfinished():
        start = time.monotonic()
        for out in engine.step(stream=False):
            done[out.request_id] = out
            finished_first = finished_first or out.request_id
        longest = max(longest, time.monotonic() - start)
    assert finished_first == "plain"            # it ran to its end while the grammar compiled
    assert longest < SLOW_COMPILE_S / 3, f"a step took {longest:.2f} s"
    assert done["grammar"].outputs[0].text.endswith("-slow") and done["grammar"].outputs[0].finish_reason == "stop"


def test_a_grammar_the_engine_cannot_compile_ends_its_request_with_the_reason(llm):
    engine = llm.engine     # past the offline front end, which would refuse it before adding
    engine.add_request([5, 9], SamplingParams(n=2, max_tokens=5, structured_outputs=StructuredOutputsParams(
        regex="(unclosed")), "bad")
    done, _ = _run_all(engine)
    samples = done["bad"].outputs
    assert [s.finish_reason for s in samples] == ["error", "error"]
    assert all("structured_outputs.regex" in s.stop_reason and "\n" not in s.stop_reason for s in samples)


def test_past_the_run_time_limits_the_reason_is_in_stop_reason(llm, monkeypatch):
    from kvfit.structured import StructuredOutputs
    engine = llm.engine
    tight = StructuredOutputs(engine.tokenizer, engine.facts.vocab_size, engine.eos_token_ids,
                              parser_limits={"step_max_items": 3})
    monkeypatch.setattr(engine, "_structured_outputs", tight)
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string"}}})
    engine.add_request([5, 9], SamplingParams(max_tokens=8, seed=0, structured_outputs=spec), "limited")
    done, _ = _run_all(engine)
    sample = done["limited"].outputs[0]
    assert sample.finish_reason == "error"
    assert "Too many items" in sample.stop_reason and "structured_outputs" in sample.stop_reason


def test_a_preparing_request_can_be_aborted(llm, monkeypatch):
    engine = llm.engine
    gate = threading.Event()
    structured = engine._structured()
    build = structured._build
    monkeypatch.setattr(structured, "_build", lambda spec: (gate.wait(30), build(spec))[1])
    engine.add_request([5], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        regex="x{1,3}-abort")), "gone")
    assert engine.abort("gone") and not engine.has_unfinished()
    gate.set()
    assert engine.step() == []


def test_bad_words_are_tokenized_off_the_engine_thread_and_bounded(llm, monkeypatch):
    engine = llm.engine
    threads, encode = set(), engine.tokenizer.encode

    def recording_encode(text, add_special_tokens=True):
        threads.add(threading.current_thread().name)
        return encode(text, add_special_tokens)
    monkeypatch.setattr(engine.tokenizer, "encode", recording_encode)
    words = tuple(f"word{i}" for i in range(MAX_BAD_WORDS))
    engine.add_request([5, 9], SamplingParams(max_tokens=3, bad_words=words), "bad-words")
    done, _ = _run_all(engine)
    assert done["bad-words"].outputs[0].finish_reason == "length"
    assert threads and threading.current_thread().name not in threads, threads
    with pytest.raises(RequestError) as info:
        engine.add_request([5, 9], SamplingParams(max_tokens=3, bad_words=words + ("one more",)), "too-many")
    assert info.value.param == "bad_words" and str(MAX_BAD_WORDS) in str(info.value)
    assert not engine.has_unfinished()
