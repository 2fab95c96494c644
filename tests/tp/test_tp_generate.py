"""tensor_parallel_size=2 gives the same greedy tokens as 1 through kvfit.LLM, and stops cleanly.

Two tiny Llamas: 2 KV heads (one per rank) and 1 KV head (replicated: tp 2 > 1 KV head), the
latter with tied embeddings and a 321-token vocabulary (the vocab-parallel embedding and lm_head
split it 161 + 160). Chunked prefill and several sequences per step run through the ranks.
"""

from __future__ import annotations

import pytest
import torch
from tp_helpers import ENGINE_KWARGS, all_gone, rank_exit_codes, rank_pids

from kvfit import LLM, SamplingParams

NUM_NEW = 10


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 23, 40)]


def _greedy(folder: str, prompts, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(folder, **ENGINE_KWARGS, max_num_batched_tokens=32, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)], llm


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_mqa_tied"])
def test_two_ranks_give_the_tokens_of_one(fixture, request):
    folder = request.getfixturevalue(fixture)
    from kvfit.model_facts import load_model_facts
    prompts = _prompts(load_model_facts(folder).vocab_size)
    expected, single = _greedy(folder, prompts)
    single.shutdown()
    got, llm = _greedy(folder, prompts, tensor_parallel_size=2)
    pids = rank_pids(llm)
    try:
        assert got == expected
        plan = llm.capacity
        assert plan.tensor_parallel_size == 2 and len(plan.per_rank_available_kv_bytes) == 2
        assert plan.kv_heads_per_rank == 1
        assert llm.engine.workers.rank_num_blocks == [plan.num_blocks] * 2
        stats = llm.engine.stats()
        assert stats["kv_blocks_used"] == 0
    finally:
        llm.shutdown()
    assert all_gone(pids, timeout_s=0), "LLM.shutdown() returned before the ranks exited"
    assert rank_exit_codes(llm.engine.workers) == [0], "the ranks did not stop when told to"
    llm.shutdown()                      # a second shutdown is a no-op


def test_an_idle_engine_keeps_its_ranks(tiny_llama, monkeypatch):
    """Waiting for the next request is not a timeout (a server may idle for hours); only start-up
    and the model's collectives are bounded by tp_timeout_s (KVFIT_TP_TIMEOUT_S; here 4 s: start-up takes ~2)."""
    import time
    llm = LLM(tiny_llama, tensor_parallel_size=2, tp_timeout_s=4, **ENGINE_KWARGS)
    try:
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        first = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
        time.sleep(4.5)
        assert llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids == first
    finally:
        llm.shutdown()
