"""The sampling surface end to end on a tiny random Llama (fp32, CPU) against transformers and reference
loops: logprobs and prompt logprobs, repetition / presence / frequency penalties, min_p, min_tokens,
logit_bias, bad_words, allowed_token_ids, n, include_stop_str_in_output, detokenize, and multi-step rounds
equal to single steps with penalties and logprobs."""

from __future__ import annotations

import pytest
import torch

from kvfit import LLM, SamplingParams

KW = dict(device="cpu", dtype="float32", block_size=4, max_model_len=96, kv_cache_memory="8MiB")
PROMPTS = [[5, 9, 23, 40, 7, 7, 12], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48]]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, **KW)


@pytest.fixture(scope="module")
def hf(tiny_llama):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@torch.inference_mode()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] fp32 logits of transformers at every position."""
    return hf(torch.tensor([ids])).logits[0].float()


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, **kw)


def test_logprobs_and_prompt_logprobs_equal_transformers_log_softmax(llm, hf):
    out = llm.generate(PROMPTS, greedy(max_tokens=6, logprobs=5, prompt_logprobs=3), use_tqdm=False)
    for prompt, o in zip(PROMPTS, out):
        sample = o.outputs[0]
        full = prompt + sample.token_ids
        ref = torch.log_softmax(hf_logits(hf, full), dim=-1)                  # [T, V]
        # sample logprobs: the chosen token's (rank 1 under greedy) and the top 5
        assert len(sample.logprobs) == 6
        total = 0.0
        for i, (token, position) in enumerate(zip(sample.token_ids, sample.logprobs)):
            row = ref[len(prompt) - 1 + i]
            assert position[token].rank == 1
            assert abs(position[token].logprob - row[token].item()) < 1e-3
            top = torch.topk(row, 5)
            assert sorted(position) == sorted(top.indices.tolist())
            for t, v in zip(top.indices.tolist(), top.values.tolist()):
                assert abs(position[t].logprob - v) < 1e-3
            total += position[token].logprob
        assert abs(sample.cumulative_logprob - total) < 1e-4
        # prompt logprobs: None first, then token p given tokens < p, with its rank and the top 3
        assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(prompt)
        for p in range(1, len(prompt)):
            row, entry = ref[p - 1], o.prompt_logprobs[p]
            assert abs(entry[prompt[p]].logprob - row[prompt[p]].item()) < 1e-3
            assert entry[prompt[p]].rank == int((row > row[prompt[p]]).sum()) + 1
            assert {t for t in entry if t != prompt[p]} <= set(torch.topk(row, 3).indices.tolist())
            assert isinstance(entry[prompt[p]].decoded_token, str)


def test_prompt_logprobs_over_chunked_prefill_and_a_cached_prefix(tiny_llama, hf):
    small = LLM(tiny_llama, **{**KW, "max_num_batched_tokens": 8, "enable_prefix_caching": True})
    prompt = PROMPTS[1]
    small.generate([prompt], greedy(max_tokens=2), use_tqdm=False)         # its blocks are now cached
    out = small.generate([prompt], greedy(max_tokens=2, prompt_logprobs=0), use_tqdm=False)[0]
    ref = torch.log_softmax(hf_logits(hf, prompt), dim=-1)
    assert out.num_cached_tokens == 0, "prompt logprobs need every position: no prefix-cache hit (vLLM)"
    for p in range(1, len(prompt)):
        assert list(out.prompt_logprobs[p]) == [prompt[p]]
        assert abs(out.prompt_logprobs[p][prompt[p]].logprob - ref[p - 1, prompt[p]].item()) < 1e-3


def test_repetition_penalty_greedy_equals_transformers_generate(llm, hf):
    for penalty in (1.3, 0.7):
        out = llm.generate(PROMPTS, greedy(max_tokens=10, repetition_penalty=penalty), use_tqdm=False)
        for prompt, o in zip(PROMPTS, out):
            ids = torch.tensor([prompt])
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                              repetition_penalty=penalty)[0, len(prompt):].tolist()
            assert o.outputs[0].token_ids == ref, f"repetition_penalty={penalty}"


def _reference_penalised_greedy(hf, prompt, n, presence, frequency, bias=None):
    out = []
    for _ in range(n):
        logits = hf_logits(hf, prompt + out)[-1].clone()
        if bias:
            for t, b in bias.items():
                logits[t] += b
        counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=logits.shape[0]).float()
        logits = logits - frequency * counts - presence * (counts > 0).float()
        out.append(int(torch.argmax(logits)))
    return out


def test_presence_and_frequency_penalties_equal_a_reference_loop(llm, hf):
    for presence, frequency in ((1.5, 0.0), (0.0, 2.0), (-0.5, 0.7)):
        out = llm.generate(PROMPTS, greedy(max_tokens=10, presence_penalty=presence, frequency_penalty=frequency),
                           use_tqdm=False)
        for prompt, o in zip(PROMPTS, out):
            assert o.outputs[0].token_ids == _reference_penalised_greedy(hf, prompt, 10, presence, frequency)


def test_logit_bias_moves_the_choice(llm, hf):
    base = llm.generate(PROMPTS[:1], greedy(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids
    bias = {17: 100.0}
    out = llm.generate(PROMPTS[:1], greedy(max_tokens=4, logit_bias=bias), use_tqdm=False)[0].outputs[0].token_ids
    assert out == [17] * 4 != base
    ban = {base[0]: -100.0}
    out = llm.generate(PROMPTS[:1], greedy(max_tokens=4, logit_bias=ban), use_tqdm=False)[0].outputs[0].token_ids
    assert out == _reference_penalised_greedy(hf, PROMPTS[0], 4, 0.0, 0.0, ban) and out[0] != base[0]


def test_min_p_one_equals_greedy(llm):
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(max_tokens=8), use_tqdm=False)]
    params = SamplingParams(temperature=1.0, min_p=1.0, ignore_eos=True, max_tokens=8)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == want


def test_min_tokens_holds_eos_back(llm):
    base = llm.generate(PROMPTS[:1], greedy(max_tokens=6), use_tqdm=False)[0].outputs[0].token_ids
    eos = base[2]                                   # make the third greedy token a stop token
    stopped = llm.generate(PROMPTS[:1], greedy(max_tokens=6, stop_token_ids=[eos]), use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == eos and len(stopped.token_ids) <= 3
    held = llm.generate(PROMPTS[:1], greedy(max_tokens=6, stop_token_ids=[eos], min_tokens=5),
                        use_tqdm=False)[0].outputs[0]
    assert eos not in held.token_ids[:5] and len(held.token_ids) >= 5


def test_bad_words_never_appear(llm):
    tok = llm.get_tokenizer()
    base = llm.generate(PROMPTS, greedy(max_tokens=10), use_tqdm=False)
    words = [tok.decode([t]) for t in base[0].outputs[0].token_ids[:3]]
    words = [w for w in words if w.strip()]
    banned = {tuple(tok.encode(w.lstrip(), add_special_tokens=False)) for w in words}
    banned |= {tuple(tok.encode(" " + w.lstrip(), add_special_tokens=False)) for w in words}
    out = llm.generate(PROMPTS, greedy(max_tokens=10, bad_words=words), use_tqdm=False)
    for o in out:
        ids = o.outputs[0].token_ids
        for seq in banned:
            assert all(tuple(ids[i:i + len(seq)]) != seq for i in range(len(ids))), (seq, ids)


def test_allowed_token_ids_limit_the_choice(llm):
    allowed = [11, 12, 13]
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=8, allowed_token_ids=allowed, seed=3, ignore_eos=True),
                       use_tqdm=False)
    assert all(set(o.outputs[0].token_ids) <= set(allowed) for o in out)


def test_n_returns_n_distinct_seeded_samples_in_order(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True, logprobs=0)
    first = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0]
    again = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0]
    assert [s.index for s in first.outputs] == [0, 1, 2, 3] and first.finished
    samples = [tuple(s.token_ids) for s in first.outputs]
    assert len(set(samples)) == 4 and samples == [tuple(s.token_ids) for s in again.outputs]
    # sample i is the seed + i request alone (vLLM's rule)
    alone = llm.generate(PROMPTS[:1], SamplingParams(temperature=1.0, seed=9, max_tokens=8, ignore_eos=True),
                         use_tqdm=False)[0]
    assert samples[2] == tuple(alone.outputs[0].token_ids)
    assert all(s.cumulative_logprob is not None and len(s.logprobs) == 8 for s in first.outputs)


def test_abort_of_a_parent_aborts_every_sample(llm):
    engine = llm.engine
    rid = engine.add_request(PROMPTS[0], SamplingParams(n=3, max_tokens=20, ignore_eos=True))
    engine.step()
    assert engine.abort(rid) and not engine.has_unfinished()
    engine.step()
    assert engine.stats()["kv_blocks_used"] == 0
    rid = engine.add_request(PROMPTS[0], SamplingParams(n=2, max_tokens=20, ignore_eos=True))
    engine.step()
    assert engine.abort(f"1_{rid}") and not engine.has_unfinished(), "one sample's id aborts them all"
    assert not engine.abort(rid)


def test_streamed_n_outputs_carry_every_sample(llm):
    engine = llm.engine
    rid = engine.add_request(PROMPTS[0], SamplingParams(n=2, max_tokens=3, ignore_eos=True, seed=1))
    seen = []
    while engine.has_unfinished():
        seen += [o for o in engine.step() if o.request_id == rid]
    assert seen and all([s.index for s in o.outputs] == [0, 1] for o in seen)
    assert seen[-1].finished and all(len(s.token_ids) == 3 for s in seen[-1].outputs)


def test_include_stop_str_in_output_and_detokenize_false(llm):
    base = llm.generate(PROMPTS[:1], greedy(max_tokens=8), use_tqdm=False)[0].outputs[0]
    stop = base.text[len(base.text) // 2:len(base.text) // 2 + 2]
    if not stop.strip():
        pytest.skip("the tiny model's text has no usable stop string here")
    cut = llm.generate(PROMPTS[:1], greedy(max_tokens=8, stop=[stop]), use_tqdm=False)[0].outputs[0]
    kept = llm.generate(PROMPTS[:1], greedy(max_tokens=8, stop=[stop], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == cut.text + stop and kept.stop_reason == stop
    raw = llm.generate(PROMPTS[:1], greedy(max_tokens=8, detokenize=False, logprobs=1), use_tqdm=False)[0].outputs[0]
    assert raw.text == "" and raw.token_ids == base.token_ids
    assert all(lp.decoded_token is None for position in raw.logprobs for lp in position.values())


def test_skip_special_tokens_false_keeps_their_text(llm):
    forced = dict(max_tokens=2, logit_bias={2: 100.0})          # id 2 is the tiny tokenizer's </s>
    kept = llm.generate(PROMPTS[:1], greedy(skip_special_tokens=False, **forced), use_tqdm=False)[0].outputs[0]
    skipped = llm.generate(PROMPTS[:1], greedy(**forced), use_tqdm=False)[0].outputs[0]
    assert kept.token_ids == skipped.token_ids == [2, 2]
    assert kept.text == "</s></s>" and skipped.text == ""


def test_multi_step_equals_single_step_with_penalties_and_logprobs(tiny_llama, llm):
    multi = LLM(tiny_llama, **{**KW, "num_scheduler_steps": 4})
    params = [SamplingParams(temperature=0.8, seed=5, max_tokens=9, ignore_eos=True, logprobs=2,
                             repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3, min_tokens=4,
                             logit_bias={3: 2.0}, min_p=0.05),
              greedy(max_tokens=9, logprobs=0, repetition_penalty=1.5)]
    one = llm.generate(PROMPTS, params, use_tqdm=False)
    many = multi.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(one, many):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert pa.keys() == pb.keys()
            assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-4 for t in pa)


def test_multi_token_bad_words_in_a_multi_step_engine(tiny_llama, llm):
    """Such a request runs one step per round beside requests that run several; the result equals single steps."""
    tok = llm.get_tokenizer()
    base = llm.generate(PROMPTS[:1], greedy(max_tokens=10), use_tqdm=False)[0].outputs[0].token_ids
    word = tok.decode(base[2:4])                       # two generated tokens as one bad word
    multi = LLM(tiny_llama, **{**KW, "num_scheduler_steps": 4})
    params = [greedy(max_tokens=10, bad_words=[word]), greedy(max_tokens=10)]
    one = llm.generate(PROMPTS, params, use_tqdm=False)
    many = multi.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in one] == [o.outputs[0].token_ids for o in many]
    ids = one[0].outputs[0].token_ids
    assert ids != base and word not in tok.decode(ids)
