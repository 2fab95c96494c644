"""The offline API in vLLM's shapes: prompts as text, token ids, {"prompt": ...} or {"prompt_token_ids": ...}
(and lists of them), one SamplingParams or one per prompt, LLM.chat through the chat template (token ids as
transformers' apply_chat_template(tokenize=True)), LLM.get_tokenizer()."""

from __future__ import annotations

import pytest

from kvfit import LLM, SamplingParams
from kvfit.errors import RequestError

KW = dict(device="cpu", dtype="float32", kv_cache_memory="4MiB", block_size=4, max_model_len=64)
GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, **KW)


def test_every_prompt_shape_gives_the_same_output(llm):
    tok = llm.get_tokenizer()
    text = "Hello world"
    ids = tok.encode(text)
    want = llm.generate(text, GREEDY, use_tqdm=False)[0]
    assert want.prompt == text and want.prompt_token_ids == ids
    for prompts in (ids, {"prompt": text}, {"prompt_token_ids": ids}, [{"prompt": text}, {"prompt_token_ids": ids}],
                    [text, ids]):
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert all(o.outputs[0].token_ids == want.outputs[0].token_ids for o in outs)
        assert all(o.prompt_token_ids == ids for o in outs)


def test_one_sampling_params_per_prompt(llm):
    outs = llm.generate([[5, 6, 7], [8, 9]], [GREEDY, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)],
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5]
    with pytest.raises(RequestError, match="2 sampling params for 3 prompts"):
        llm.generate([[5], [6], [7]], [GREEDY, GREEDY], use_tqdm=False)


@pytest.mark.parametrize("prompt", [{"text": "hi"}, {"prompt": 5, "prompt_token_ids": [1]}, {"prompt": 5},
                                    {"prompt_token_ids": "abc"}])
def test_bad_prompt_dicts_are_one_line_errors(llm, prompt):
    with pytest.raises(RequestError, match="prompt") as info:
        llm.generate(prompt, GREEDY, use_tqdm=False)
    assert "\n" not in str(info.value)


def test_chat_uses_the_template_token_ids(llm, tiny_llama):
    from transformers import AutoTokenizer
    messages = [{"role": "user", "content": "Hello there"}]
    want = llm.get_tokenizer().apply_chat_template(messages, True, tokenize=True)
    reference = AutoTokenizer.from_pretrained(tiny_llama).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert want == list(reference)
    out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == want and len(out.outputs[0].token_ids) == 3
    two = llm.chat([messages, messages + [{"role": "assistant", "content": "Hi"}, {"role": "user", "content": "?"}]],
                   GREEDY, use_tqdm=False)
    assert two[0].outputs[0].token_ids == out.outputs[0].token_ids and len(two) == 2
    custom = llm.chat(messages, GREEDY, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}",
                      add_generation_prompt=False, use_tqdm=False)[0]
    assert custom.prompt_token_ids == llm.get_tokenizer().encode("Hello there", add_special_tokens=False)
    with pytest.raises(RequestError, match="messages"):
        llm.chat("hello", GREEDY, use_tqdm=False)
