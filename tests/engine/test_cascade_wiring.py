"""Cascade attention's wiring, on CPU: the scheduler's common prefix blocks reach the attention backend of
every decode step as AttentionMetadata.prefix_len, and what it names is true (whole blocks every sequence holds
at the same positions, each sequence longer), through the real engine (async rounds, multi-step, a request
that shares nothing joining). The spy backend attends the prefix through row 0's blocks, as the Triton
cascade kernel does, so a wrong prefix changes the tokens. The kernel itself is tested against the reference
in tests/attention/test_triton_backend.py; CUDA graphs with cascade in tests/gpu/test_engine_gpu.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvfit import LLM, SamplingParams
from kvfit.attention.torch_ref import TorchReferenceBackend

SHARED = list(range(10, 34))                    # 24 tokens: six blocks of 4


@pytest.fixture
def spy(monkeypatch):
    """Patch the torch backend to take every shared prefix and attend it through row 0's blocks; return the
    prefix lengths it saw."""
    seen: list[int] = []
    attend = TorchReferenceBackend.attend

    def attend_prefix(self, query, k_cache, v_cache, meta, scale, out_scale=None):
        if meta.prefix_len is None:
            return attend(self, query, k_cache, v_cache, meta, scale, out_scale)
        prefix = int(meta.prefix_len.item())
        blocks = prefix // k_cache.shape[1]
        lens = meta.seq_lens_host or meta.seq_lens.tolist()
        assert meta.decode_only and prefix % k_cache.shape[1] == 0 and all(n > prefix for n in lens)
        tables = meta.block_tables
        for cache in (k_cache, v_cache):        # the same K/V (maybe in duplicate blocks): what row 0's hold
            torch.testing.assert_close(cache[tables[:, :blocks].long()],
                                       cache[tables[:1, :blocks].long()].expand(len(lens), -1, -1, -1, -1),
                                       msg="a prefix the sequences do not share")
        seen.append(prefix)
        tables = tables.clone()
        tables[:, :blocks] = tables[0, :blocks]
        return attend(self, query, k_cache, v_cache, dataclasses.replace(meta, block_tables=tables), scale, out_scale)

    monkeypatch.setattr(TorchReferenceBackend, "attend", attend_prefix)
    monkeypatch.setattr(TorchReferenceBackend, "cascade_tokens",
                        lambda self, shared, num_seqs: shared if num_seqs >= 2 and shared >= 4 else 0)
    return seen


def _generate(folder, prompts, params, warm=True, **kw):
    llm = LLM(folder, device="cpu", dtype="float32", max_model_len=96, block_size=4, kv_cache_memory="16MiB",
              enable_prefix_caching=True, **kw)
    if warm:        # cache the prefix: the requests hit it; else those admitted together compute copies of it
        llm.generate([SHARED + [1]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    stats = llm.engine.stats()
    assert stats["kv_blocks_used"] == 0
    llm.engine.kv.check_invariants()
    return out


@pytest.mark.parametrize("steps,async_scheduling,warm", [(1, False, True), (1, True, True), (4, True, True),
                                                         (1, True, False)])
def test_decode_steps_attend_the_shared_prefix_once_with_the_same_tokens(tiny_qwen3, spy, steps, async_scheduling,
                                                                         warm):
    prompts = [SHARED + [40 + i] * (1 + i % 3) for i in range(6)] + [[70, 71, 72]]   # the last shares nothing
    params = [SamplingParams(temperature=0, max_tokens=6 + 2 * i, ignore_eos=True) for i in range(6)]
    params.append(SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    kw = {"num_scheduler_steps": steps, "async_scheduling": async_scheduling, "warm": warm}
    plain = _generate(tiny_qwen3, prompts, params, disable_cascade_attn=True, **kw)
    assert not spy
    got = _generate(tiny_qwen3, prompts, params, **kw)
    assert got == plain
    # while the request sharing nothing runs nothing is common; once it ends (3 tokens) the six share 24 tokens
    assert spy and max(spy) == len(SHARED)


def test_disable_cascade_attn_is_a_checked_flag(tiny_llama):
    from kvfit.errors import ConfigError
    with pytest.raises(ConfigError, match="--disable-cascade-attn must be true or false"):
        LLM(tiny_llama, device="cpu", disable_cascade_attn="yes")


def test_without_prefix_caching_there_is_no_cascade(tiny_qwen3, spy):
    # shared prefixes are found through prefix caching's hashes: without it no step marks one (and the runner
    # asks no rule, so no cascade graphs are captured on a GPU)
    llm = LLM(tiny_qwen3, device="cpu", dtype="float32", max_model_len=96, block_size=4, kv_cache_memory="16MiB",
              enable_prefix_caching=False)
    assert llm.engine.workers.runner._cascade_tokens is None
    prompts = [SHARED + [40 + i] for i in range(6)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [5] * 6 and not spy
    llm.shutdown()
