"""End to end: kvfit's greedy tokens equal transformers' greedy generate (fp32, CPU), token for token.

The models are tiny random-weight Llama / Qwen2 (bias) / Qwen3 (head_dim != hidden/heads) folders
built with transformers' own classes (tests/conftest.py). Each kvfit run batches all prompts; the
reference runs each prompt alone. Settings cover prefix caching on and off, chunked prefill, and a
cache small enough to force preemption.
"""

from __future__ import annotations

import pytest
import torch

from kvfit import LLM, SamplingParams

NUM_NEW = 12
PROMPT_LENS = (3, 17, 33, 40, 9)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(5, vocab, (20,), generator=g).tolist()
    out = []
    for i, n in enumerate(PROMPT_LENS):
        tail = torch.randint(5, vocab, (n,), generator=g).tolist()
        out.append(shared + tail if i % 2 else tail)     # half share a 20-token prefix
    return out


@torch.inference_mode()
def _hf_greedy(folder: str, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    # compare NUM_NEW tokens whatever they are: no eos anywhere generate could find one
    # (generate fills unset fields of a passed config from the model's own, so edit that one)
    config = model.generation_config
    config.eos_token_id = None
    model.config.eos_token_id = None
    config.pad_token_id = 0
    config.max_new_tokens, config.do_sample = NUM_NEW, False
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        out.append(gen[0, len(p):].tolist())
    return out


SETTINGS = {
    "prefix_caching": dict(enable_prefix_caching=True),
    "no_prefix_caching": dict(enable_prefix_caching=False),
    "chunked_prefill": dict(enable_prefix_caching=True, max_num_batched_tokens=16, max_num_seqs=3),
    # 20 blocks of 4 tokens: one 80-token request fits, the batch does not
    "preemption": dict(enable_prefix_caching=False, num_gpu_blocks_override=20, max_num_seqs=4, max_model_len=80),
    "multi_step": dict(enable_prefix_caching=True, num_scheduler_steps=5),
}


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_greedy_matches_transformers(fixture, request):
    folder = request.getfixturevalue(fixture)
    from kvfit.model_facts import load_model_facts
    vocab = load_model_facts(folder).vocab_size
    prompts = _prompts(vocab)
    expected = _hf_greedy(folder, prompts)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    for name, settings in SETTINGS.items():
        kwargs = dict(device="cpu", dtype="float32", block_size=4, max_model_len=128)
        kwargs.update(settings)
        llm = LLM(folder, **kwargs)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outputs]
        assert got == expected, f"{fixture} with {name}"
        stats = llm.engine.stats()
        assert stats["kv_blocks_used"] == 0
        assert stats["kv_blocks_free"] + stats["kv_blocks_cached"] == stats["kv_blocks_total"]
        if name == "preemption":
            assert stats["preemptions"] > 0, "the small cache should have forced preemption"
        if name == "prefix_caching":
            # the first batch registered its full blocks: the same prompts now hit the cache
            again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            assert again == expected
            assert llm.engine.stats()["prefix_cache_hits"] > 0


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_llama):
    llm = LLM(tiny_llama, device="cpu", dtype="float32", max_model_len=128)
    p = SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=123, max_tokens=10, ignore_eos=True)
    alone = llm.generate([[5, 6, 7, 8]], p, use_tqdm=False)[0].outputs[0].token_ids
    batched = llm.generate([[9, 10, 11], [5, 6, 7, 8], [12] * 7], p, use_tqdm=False)[1].outputs[0].token_ids
    assert alone == batched
    other = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.9, seed=124, max_tokens=10, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert len(other) == 10


def test_text_prompts_stop_strings_and_max_tokens(tiny_llama):
    llm = LLM(tiny_llama, device="cpu", dtype="float32", max_model_len=128)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full = llm.generate(["the quick brown fox"], greedy, use_tqdm=False)[0]
    assert len(full.outputs[0].token_ids) == 20 and full.outputs[0].finish_reason == "length"
    assert full.outputs[0].text == llm.get_tokenizer().decode(full.outputs[0].token_ids)
    if len(full.outputs[0].text.strip()) > 2:
        stop = full.outputs[0].text.strip()[1:3]
        cut = llm.generate(["the quick brown fox"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                                   stop=[stop]), use_tqdm=False)[0]
        assert cut.outputs[0].finish_reason == "stop"
        assert stop not in cut.outputs[0].text and full.outputs[0].text.startswith(cut.outputs[0].text)
    stop_id = full.outputs[0].token_ids[3]
    by_id = llm.generate(["the quick brown fox"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                                 stop_token_ids=[stop_id]), use_tqdm=False)[0]
    assert by_id.outputs[0].token_ids == full.outputs[0].token_ids[:full.outputs[0].token_ids.index(stop_id) + 1]
    assert by_id.outputs[0].finish_reason == "stop"


def test_bad_requests_are_clear_errors(tiny_llama):
    from kvfit.errors import ConfigError, RequestError
    llm = LLM(tiny_llama, device="cpu", dtype="float32", max_model_len=64)
    with pytest.raises(RequestError, match="max-model-len"):
        llm.generate([[5] * 64], SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(RequestError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(RequestError, match="a prompt must be a string or a list of token ids") as info:
        llm.engine.add_request(None, SamplingParams(max_tokens=1))
    assert info.value.param == "prompt"
    with pytest.raises(ConfigError, match="unknown attention backend 'flash'"):
        LLM(tiny_llama, device="cpu", attention_backend="flash")
    assert llm.engine.stats()["kv_blocks_used"] == 0 and not llm.engine.has_unfinished()
    with pytest.raises(ConfigError, match="unknown setting"):
        LLM(tiny_llama, device="cpu", not_a_flag=1)
    with pytest.raises(ConfigError, match="max-model-len"):
        LLM(tiny_llama, device="cpu", max_model_len=10**7)


def test_capacity_is_the_plan(tiny_llama):
    llm = LLM(tiny_llama, device="cpu", dtype="float32", kv_cache_memory="8MiB", max_model_len=128)
    plan = llm.capacity
    assert plan.num_blocks == (8 << 20) // llm.engine.spec.bytes_per_block
    assert plan.bound_by == "memory" and llm.engine.pool.num_blocks == plan.num_blocks
