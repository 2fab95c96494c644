"""LLM(...) as a vLLM script calls it: its keyword arguments, numpy and torch values (converted once at the
boundary), SamplingParams.clone, chat outputs carrying their prompt, errors that name the value."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvfit import LLM, SamplingParams
from kvfit.errors import ConfigError, RequestError

SMALL = dict(device="cpu", dtype="float32", kv_cache_memory="16MiB", max_model_len=64, max_num_batched_tokens=64,
             max_num_seqs=4)
GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    # every vLLM keyword argument a script passes that asks for what kvfit does anyway
    llm = LLM(tiny_llama, trust_remote_code=True, tokenizer=tiny_llama, hf_overrides={}, disable_log_stats=True,
              skip_tokenizer_init=False, enable_chunked_prefill=True, swap_space=4, tokenizer_mode="auto", **SMALL)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("kwargs, needle", [
    (dict(skip_tokenizer_init=True), "without tokenizer.json"),
    (dict(enable_lora=True), "LoRA"),
    (dict(hf_overrides={"num_hidden_layers": 1}), "config.json is read as it is"),
    (dict(pipeline_parallel_size=2), "pipeline parallelism"),
    (dict(enable_chunked_prefill=False), "always split"),
    (dict(swap_space=-1), "swap_space"),
    (dict(trust_remote_code="yes"), "never runs code"),
    (dict(distributed_executor_backend="ray"), "processes of this host"),
])
def test_vllm_kwargs_kvfit_cannot_honour_say_why(tiny_llama, kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        LLM(tiny_llama, **kwargs, **SMALL)


def test_numpy_settings_and_none_are_taken(tiny_llama):
    from kvfit.config import EngineConfig
    kwargs = {**SMALL, "max_model_len": np.int64(64), "max_num_seqs": torch.tensor(4), "seed": None, "block_size": None,
              "enforce_eager": None}     # None: the setting's default, as vLLM's LLM takes it
    llm = LLM.__new__(LLM)
    llm._start = lambda config: setattr(llm, "config", config)       # the config only: no engine started
    LLM.__init__(llm, tiny_llama, **kwargs)
    assert llm.config == EngineConfig.from_kwargs(tiny_llama, **SMALL)


def test_a_tokenizer_of_another_folder_is_refused(tiny_llama, tiny_qwen2):
    with pytest.raises(ConfigError, match="not the model's folder"):
        LLM(tiny_llama, tokenizer=tiny_qwen2, **SMALL)


def test_numpy_and_torch_prompts_and_params_equal_plain_ones(llm):
    ids = [5, 6, 7, 8]
    want = llm.generate([ids], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    params = SamplingParams(temperature=np.float32(0.0), max_tokens=np.int64(3), ignore_eos=np.bool_(True),
                            top_k=torch.tensor(-1))
    assert params == GREEDY and type(params.max_tokens) is int
    for prompt in (np.array(ids), torch.tensor(ids), [np.int64(t) for t in ids], {"prompt_token_ids": np.array(ids)}):
        out = llm.generate(prompt, params, use_tqdm=False)
        assert len(out) == 1 and out[0].outputs[0].token_ids == want and out[0].prompt_token_ids == ids
    batch = llm.generate(np.array([ids, ids]), params, use_tqdm=False)      # a 2-D array: a batch of prompts
    assert [o.outputs[0].token_ids for o in batch] == [want, want]


def test_wrong_types_are_named_as_types(llm):
    for kwargs, needle in ((dict(temperature="0.5"), "temperature must be a number, got str"),
                           (dict(max_tokens=3.0), "max_tokens must be an integer, got float"),
                           (dict(n=np.float64(2.0)), "n must be an integer, got float64")):
        with pytest.raises(RequestError, match=needle):
            SamplingParams(**kwargs)
    with pytest.raises(RequestError, match="prompt token ids must be integers, got float 1.0"):
        llm.generate(np.array([1.0, 2.0]), GREEDY, use_tqdm=False)


def test_an_out_of_vocabulary_prompt_id_is_named(llm):
    with pytest.raises(RequestError, match=r"got 99999 at position 1"):
        llm.generate([[5, 99999, 6]], GREEDY, use_tqdm=False)


def test_clone_and_a_mutation_says_to_use_clone():
    params = SamplingParams(temperature=0.5, logit_bias={3: 1.0})
    copy = params.clone()
    assert copy == params and copy is not params
    assert params.clone(temperature=0).temperature == 0 and params.temperature == 0.5
    with pytest.raises(dataclasses.FrozenInstanceError, match=r"clone\(temperature=\.\.\.\).*dataclasses.replace"):
        params.temperature = 0.0
    with pytest.raises(RequestError, match="temperature"):
        params.clone(temperature=-1)            # checked as at construction


def test_chat_outputs_carry_the_rendered_prompt(llm):
    messages = [{"role": "user", "content": "hello"}]
    out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    text = llm.get_tokenizer().apply_chat_template(messages, True)
    assert out.prompt == text and "hello" in text
    assert out.prompt_token_ids == llm.get_tokenizer().encode(text, add_special_tokens=False)


def test_chat_renders_tools_and_tool_call_history(llm):
    template = ("{% for t in tools or [] %}TOOL {{ t.function.name }};{% endfor %}{% for m in messages %}"
                "{% for c in m.tool_calls or [] %}CALL {{ c.function.arguments.city }};{% endfor %}"
                "{{ m.role }}: {{ m.content }};{% endfor %}")
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "1", "content": "sunny"}]
    tools = [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}]
    out = llm.chat(messages, GREEDY, use_tqdm=False, chat_template=template, tools=tools)[0]
    assert out.prompt == "TOOL w;user: weather?;CALL Oslo;assistant: ;tool: sunny;"
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'      # the caller's as given


def test_chat_joins_text_parts_as_the_server_and_vllm_do(llm):
    """A message's content as OpenAI text parts reached the template as a list; it is one string, the parts
    joined by a line break (the server's rendering too); a part other than text is a one-line RequestError."""
    template = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    out = llm.chat(parts, GREEDY, use_tqdm=False, chat_template=template)[0]
    assert out.prompt == "[a\nb]"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(RequestError, match=r"messages\[0\].content holds a 'image_url' part") as info:
        llm.chat(image, GREEDY, use_tqdm=False, chat_template=template)
    assert "\n" not in str(info.value)


def test_a_chat_message_whose_content_is_null_renders_empty(llm):
    """An assistant turn of tool calls alone has content None: the template gets "" (vLLM's reading), not "None"."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                {"role": "user", "content": "again"}]
    (out,) = llm.chat(messages, GREEDY, use_tqdm=False)
    assert "None" not in out.prompt
    (same,) = llm.chat([dict(m, content=m["content"] or "") for m in messages], GREEDY, use_tqdm=False)
    assert out.prompt == same.prompt and out.outputs[0].token_ids == same.outputs[0].token_ids


def test_vllm_prompt_dicts_and_call_arguments(llm):
    """vLLM's TokensPrompt may carry the "prompt" text its ids came from (the output's prompt), multimodal keys as
    None; lora_request=None, a tqdm-like callable for use_tqdm and llm.llm_engine are vLLM's calls too."""
    ids = llm.get_tokenizer().encode("hello world")
    plain, with_text, media_none = llm.generate(
        [{"prompt_token_ids": ids}, {"prompt_token_ids": ids, "prompt": "hello world"},
         {"prompt": "hello world", "multi_modal_data": None, "mm_processor_kwargs": None}], GREEDY, use_tqdm=False,
        lora_request=None)
    assert plain.prompt is None and with_text.prompt == "hello world" and media_none.prompt == "hello world"
    assert plain.outputs[0].token_ids == with_text.outputs[0].token_ids == media_none.outputs[0].token_ids
    bars = []

    class Bar:
        def __init__(self, **kwargs):
            bars.append(kwargs)

        def update(self, n):
            bars.append(n)

        def close(self):
            bars.append("closed")
    llm.generate("hello", GREEDY, use_tqdm=Bar)
    assert bars[0]["total"] == 1 and bars[1:] == [1, "closed"]
    assert llm.llm_engine is llm.engine
    with pytest.raises(ConfigError, match="LoRA adapters are not implemented"):
        llm.generate("hello", GREEDY, lora_request=object())
    with pytest.raises(RequestError, match="multi_modal_data: kvfit serves text models only"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": 1}}, GREEDY)


def test_a_torch_dtype_is_taken_as_its_name(tiny_llama):
    llm = LLM(tiny_llama, **dict(SMALL, dtype=torch.float32))
    try:
        assert llm.config.model.dtype == "float32"
    finally:
        llm.shutdown()


def test_get_tokenizer_answers_transformers_names(llm, tiny_llama):
    """What a vLLM script reads from LLM.get_tokenizer(), against transformers' tokenizer of the same folder."""
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(tiny_llama)
    tok = llm.get_tokenizer()
    assert (tok.eos_token, tok.bos_token, tok.eos_token_id, tok.bos_token_id) == \
        (hf.eos_token, hf.bos_token, hf.eos_token_id, hf.bos_token_id)
    assert tok("hello world")["input_ids"] == hf("hello world")["input_ids"]
    assert tok(["a b", "c"])["input_ids"] == hf(["a b", "c"])["input_ids"]
    assert len(tok) == len(hf) and tok.get_vocab() == hf.get_vocab()
    assert tok.tokenize("hello world") == hf.tokenize("hello world")
    assert tok.convert_tokens_to_ids(tok.tokenize("hello")) == hf.convert_tokens_to_ids(hf.tokenize("hello"))
    ids = hf("hello world")["input_ids"]
    assert tok.batch_decode([ids, ids[1:]]) == hf.batch_decode([ids, ids[1:]], skip_special_tokens=True)
    assert set(tok.all_special_ids) == set(hf.all_special_ids)
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, enable_thinking=False) == \
        hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, enable_thinking=False)


def test_request_ids_count_as_vllms_do(llm):
    first, second = llm.generate(["a", "b"], GREEDY, use_tqdm=False)
    assert first.request_id.isdigit() and int(second.request_id) == int(first.request_id) + 1


def test_get_tokenizer_special_ids_unknown_tokens_and_refused_options(tiny_llama, tmp_path):
    """all_special_ids holds tokenizer_config.json's additional special tokens (ChatML's <|im_start|>), as
    transformers'; an unknown token is the unk token's id; transformers' own apply_chat_template options (return_dict,
    return_tensors, ...) are refused, not read as template variables."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from kvfit.text.tokenizer import Tokenizer
    folder = tmp_path / "chatml"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    hf0 = AutoTokenizer.from_pretrained(str(folder))
    extra = next(t for t in hf0.get_vocab() if t not in hf0.all_special_tokens and t.isalpha() and len(t) > 2)
    config["additional_special_tokens"] = [extra]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    hf, tok = AutoTokenizer.from_pretrained(str(folder)), Tokenizer.from_folder(str(folder))
    assert set(tok.all_special_ids) == set(hf.all_special_ids) and hf.convert_tokens_to_ids(extra) in tok.all_special_ids
    assert tok.convert_tokens_to_ids(["no-such-token-xyz", extra]) == hf.convert_tokens_to_ids(["no-such-token-xyz", extra])
    with pytest.raises(RequestError, match=r"apply_chat_template\(return_dict=...\) is transformers' option"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True, return_dict=True)


def test_a_capped_fp8_weight_never_takes_the_unquantized_gemv(monkeypatch):
    """fbgemm_fp8's cap applies at one token too: the GEMV reads x unquantized, so a capped weight's token takes the
    quantizing GEMM (on a GPU; forced here)."""
    from kvfit.kernels import fp8_gemv
    from kvfit.kernels.fp8 import Fp8Weight, quantize_weight_per_channel
    monkeypatch.setattr(fp8_gemv, "triton_applies", lambda x: True)
    wq, scale = quantize_weight_per_channel(torch.randn(8, 16))
    x = torch.randn(1, 16, dtype=torch.bfloat16)
    assert fp8_gemv.fp8_gemv_applies(x, Fp8Weight(wq, scale, None))
    assert not fp8_gemv.fp8_gemv_applies(x, Fp8Weight(wq, scale, None, None, 1200.0))
