"""Async scheduling on a GPU through mixed steps: prompts chunked over several steps beside decodes, requests
arriving mid-run, prompt logprobs and logprobs read from pinned copies after the next step was launched, the
device's sampled tokens scattered into a mixed step's inputs, a grammar request joining a running batch.
Greedy tokens equal transformers' (fp32); async equals sync in tokens and (within fp32 noise) in logprobs.

Run: python -m pytest tests/gpu/test_async_gpu.py -q
"""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("triton")

from kvfit import LLM, SamplingParams  # noqa: E402

PROMPTS = [list(range(9, 40)), [5, 6, 7], list(range(100, 170)), [30] * 20, [40, 41], list(range(200, 245))]
MAX_TOKENS = [20, 9, 14, 25, 6, 12]
FIRST_WAVE = 3          # added before the first step; the rest arrive after a few steps


def _hf_greedy(folder, prompts, max_tokens):
    from test_engine_gpu import _hf_greedy as hf
    return hf(folder, prompts, max_tokens)


def _run(folder, device, async_scheduling, steps, params, kv_cache_memory="512MiB"):
    """Outputs by prompt index: a 16-token budget chunks the long prompts beside the running decodes."""
    llm = LLM(folder, device=device, dtype="float32", kv_cache_memory=kv_cache_memory, max_model_len=256,
              max_num_seqs=8, max_num_batched_tokens=16, num_scheduler_steps=steps, async_scheduling=async_scheduling)
    engine = llm.engine
    assert engine.async_scheduling is async_scheduling
    taken, inner = [], None
    if async_scheduling:        # count the continuations made after a step that was not all-decode
        inner = engine.scheduler.schedule_continuation

        def watched(prev, num_steps):
            after = inner(prev, num_steps)
            taken.append(after is not None and prev.num_tokens != len(prev.request_ids))
            return after
        engine.scheduler.schedule_continuation = watched
    ids = [engine.add_request(p, q) for p, q in zip(PROMPTS[:FIRST_WAVE], params[:FIRST_WAVE])]
    outputs = {}
    for _ in range(3):
        for out in engine.step(stream=False):
            outputs[out.request_id] = out
    ids += [engine.add_request(p, q) for p, q in zip(PROMPTS[FIRST_WAVE:], params[FIRST_WAVE:])]
    while engine.has_unfinished():
        for out in engine.step(stream=False):
            outputs[out.request_id] = out
    assert engine.stats()["kv_blocks_used"] == 0
    result = [outputs[rid] for rid in ids]
    llm.shutdown()
    llm = engine = inner = None     # the wrapper above is a reference cycle that holds the engine's KV cache
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return result, sum(taken)


def _logprob_rows(entries):
    """[(token ids, logprobs)] per position (None where a position has none), sorted by token id."""
    rows = []
    for entry in entries or []:
        items = sorted(entry.items()) if entry is not None else []
        rows.append(([t for t, _ in items], [v.logprob for _, v in items]))
    return rows


def _close(a, b, tol=1e-3) -> bool:
    return len(a) == len(b) and all(ta == tb and all(abs(x - y) <= tol for x, y in zip(va, vb))
                                    for (ta, va), (tb, vb) in zip(a, b))


@pytest.mark.parametrize("steps", [1, 8])
def test_async_through_mixed_steps_matches_transformers_and_sync(tiny_llama, steps, device="cuda"):
    expected = _hf_greedy(tiny_llama, PROMPTS, MAX_TOKENS)
    greedy = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2,
                             prompt_logprobs=2 if i % 2 == 0 else None) for i, n in enumerate(MAX_TOKENS)]
    sampled = [SamplingParams(temperature=0.9, top_p=0.95, seed=7 + i, max_tokens=n, ignore_eos=True,
                              presence_penalty=0.3) for i, n in enumerate(MAX_TOKENS)]
    memory = "512MiB" if device == "cuda" else "16MiB"
    got, mixed = _run(tiny_llama, device, True, steps, greedy, memory)
    sync, _ = _run(tiny_llama, device, False, steps, greedy, memory)
    assert mixed >= 3, "no continuation after a mixed step: the path under test did not run"
    assert [o.outputs[0].token_ids for o in got] == expected, "async greedy tokens differ from transformers"
    assert [o.outputs[0].token_ids for o in sync] == expected
    for a, s in zip(got, sync):
        assert _close(_logprob_rows(a.outputs[0].logprobs), _logprob_rows(s.outputs[0].logprobs))
        assert _close(_logprob_rows(a.prompt_logprobs), _logprob_rows(s.prompt_logprobs))
        assert (a.prompt_logprobs is None) == (s.prompt_logprobs is None)
    got, _ = _run(tiny_llama, device, True, steps, sampled, memory)
    sync, _ = _run(tiny_llama, device, False, steps, sampled, memory)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in sync]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_grammar_request_joining_a_running_batch(tiny_llama, async_scheduling, device="cuda"):
    # the grammar request is sampled after a plain one: its bitmask row masks its own batch position
    pytest.importorskip("llguidance")
    from kvfit.structured_params import StructuredOutputsParams
    grammar = SamplingParams(temperature=0, max_tokens=6,
                             structured_outputs=StructuredOutputsParams(regex=r"[0-9]{2}-[a-c]{1,3}"))
    kw = dict(device=device, dtype="float32", kv_cache_memory="512MiB" if device == "cuda" else "16MiB",
              max_model_len=128, async_scheduling=async_scheduling)
    alone = LLM(tiny_llama, **kw)
    expected = alone.generate([[40, 41]], grammar, use_tqdm=False)[0].outputs[0]
    alone.shutdown()
    llm = LLM(tiny_llama, **kw)
    engine = llm.engine
    engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), request_id="plain")
    engine.step()
    engine.step()
    engine.add_request([40, 41], grammar, request_id="g")
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step(stream=False):
            outputs[out.request_id] = out
    assert (outputs["g"].outputs[0].token_ids, outputs["g"].outputs[0].text) == (expected.token_ids, expected.text)
    assert engine.stats()["kv_blocks_used"] == 0
    llm.shutdown()
