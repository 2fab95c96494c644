"""`kvfit serve` end to end through its engine core process: what crosses the process boundary
(text, token ids, logprobs, prompt logprobs, n samples, stop strings, errors, stats) equals what the
in-process engine gives for the same request, streamed or not, and every block comes back."""

from __future__ import annotations

import json
import pathlib

import httpx
import pytest

from server_testing import openai_error, wait_for_drain, wait_healthy
from test_server_cli import read_until, serving
from kvfit import LLM, SamplingParams

FLAGS = ("--served-model-name", "tiny", "--enable-prefix-caching")


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "stderr.txt"
    with serving(tiny_llama, *FLAGS, log_path=log) as (proc, lines):
        url = read_until(lines, r"listening on (http://127\.0\.0\.1:\d+)", timeout_s=120)[0].group(1)
        wait_healthy(url)
        yield url
    assert "Traceback" not in log.read_text()


@pytest.fixture(scope="module")
def offline(tiny_llama):
    # the same engine settings as test_server_cli's `kvfit serve` line
    return LLM(pathlib.Path(tiny_llama), device="cpu", dtype="float32", max_model_len=128,
               num_gpu_blocks_override=32, enable_prefix_caching=True)


def _stream(url: str, body: dict) -> tuple[dict[int, str], dict[int, list], dict[int, str]]:
    texts, tokens, reasons = {}, {}, {}
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                i = choice["index"]
                texts[i] = texts.get(i, "") + choice["text"]
                if choice["logprobs"] is not None:
                    tokens.setdefault(i, []).extend(choice["logprobs"]["token_logprobs"])
                if choice["finish_reason"] is not None:
                    reasons[i] = choice["finish_reason"]
    return texts, tokens, reasons


def test_greedy_text_and_logprobs_equal_the_in_process_engine(served, offline):
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 12, "temperature": 0, "logprobs": 3,
            "ignore_eos": True, "prompt_logprobs": 2}
    whole = httpx.post(f"{served}/v1/completions", json=body, timeout=60).json()
    ref = offline.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=12, logprobs=3,
                                                            ignore_eos=True, prompt_logprobs=2), use_tqdm=False)[0]
    choice = whole["choices"][0]
    assert choice["text"] == ref.outputs[0].text
    got = choice["logprobs"]["token_logprobs"]
    want = [step[t].logprob for t, step in zip(ref.outputs[0].token_ids, ref.outputs[0].logprobs)]
    assert got == pytest.approx(want, abs=1e-4)
    assert len(choice["prompt_logprobs"]) == len(ref.prompt_token_ids)
    streamed = {k: v for k, v in body.items() if k != "prompt_logprobs"}      # not with stream (vLLM)
    texts, tokens, reasons = _stream(served, streamed)
    assert texts == {0: choice["text"]} and reasons == {0: "length"}
    assert tokens[0] == pytest.approx(got, abs=1e-6)


def test_n_samples_and_a_stop_string_cross_the_boundary(served, offline):
    params = dict(temperature=0.8, seed=7, max_tokens=10, ignore_eos=True)
    body = {"model": "tiny", "prompt": "Once", "n": 3, **params}
    whole = httpx.post(f"{served}/v1/completions", json=body, timeout=60).json()
    ref = offline.generate(["Once"], SamplingParams(n=3, **params), use_tqdm=False)[0]
    assert [c["text"] for c in whole["choices"]] == [s.text for s in sorted(ref.outputs, key=lambda s: s.index)]
    texts, _, _ = _stream(served, body)
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    # a stop string taken from the output itself: the text is cut before it, streamed or not
    full = whole["choices"][0]["text"]
    stop = full[len(full) // 2:len(full) // 2 + 2]
    if stop.strip():
        cut = httpx.post(f"{served}/v1/completions", json={**body, "n": 1, "stop": [stop]}, timeout=60).json()
        assert cut["choices"][0]["finish_reason"] == "stop"
        assert stop not in cut["choices"][0]["text"]
        texts, _, reasons = _stream(served, {**body, "n": 1, "stop": [stop]})
        assert texts[0] == cut["choices"][0]["text"] and reasons == {0: "stop"}


@pytest.mark.parametrize("include_stop", [False, True])
def test_front_end_text_ends_at_a_stop_token_as_the_engine_does(served, offline, include_stop):
    """The front-end makes the text of a request without stop strings: a stop token id ends it with or without
    its text (include_stop_str_in_output) as the in-process engine's text does; special tokens shown or not;
    the prompt logprobs' token texts equal the engine's."""
    params = dict(temperature=0, max_tokens=12, ignore_eos=True)
    first = offline.generate(["Hello there"], SamplingParams(**params), use_tqdm=False)[0].outputs[0]
    stop_id = first.token_ids[5]
    for extra in ({"stop_token_ids": [stop_id], "include_stop_str_in_output": include_stop},
                  {"skip_special_tokens": include_stop, "prompt_logprobs": 1}):
        body = {"model": "tiny", "prompt": "Hello there", **params, **extra}
        whole = httpx.post(f"{served}/v1/completions", json=body, timeout=60).json()
        ref = offline.generate(["Hello there"], SamplingParams(**params, **extra), use_tqdm=False)[0]
        choice = whole["choices"][0]
        assert choice["text"] == ref.outputs[0].text and choice["finish_reason"] == ref.outputs[0].finish_reason
        if "prompt_logprobs" in extra:
            got = [None if p is None else {int(t): e["decoded_token"] for t, e in p.items()}
                   for p in choice["prompt_logprobs"]]
            want = [None if p is None else {t: e.decoded_token for t, e in p.items()} for p in ref.prompt_logprobs]
            assert got == want
            continue
        assert choice["finish_reason"] == "stop"
        texts, _, reasons = _stream(served, body)
        assert texts == {0: choice["text"]} and reasons == {0: "stop"}


def test_refusals_keep_their_param_and_every_block_comes_back(served):
    r = httpx.post(f"{served}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 500}, timeout=30)
    assert r.status_code == 400 and openai_error(r)["param"] in ("max_tokens", "prompt"), r.text
    r = httpx.post(f"{served}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 1,
                                                    "n": 2 ** 40}, timeout=30)
    assert r.status_code == 400 and openai_error(r)["param"] == "n", r.text
    # a stream dropped mid-way: its blocks are freed in the core process
    with httpx.stream("POST", f"{served}/v1/completions", timeout=30, json={
            "model": "tiny", "prompt": "Hi", "max_tokens": 100, "ignore_eos": True, "stream": True}) as s:
        next(s.iter_lines())
    m = wait_for_drain(served)
    assert m['kvfit_kv_blocks{state="used"}'] == 0
