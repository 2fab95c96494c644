"""Chat prompts as token ids, the way transformers' apply_chat_template(tokenize=True) makes them.

The reference is transformers' PreTrainedTokenizerFast built from the same tokenizer.json, config
and template: a template that writes `{{ bos_token }}` gets exactly one bos (the rendered text is
encoded without adding special tokens), continue_final_message leaves the last message open, and
template kwargs (chat_template_kwargs) reach the template.
"""

from __future__ import annotations

import pytest

from kvfit.errors import ConfigError, RequestError
from kvfit.text.chat_template import load_chat_template, template_variables
from kvfit.text.tokenizer import load_tokenizer

# Llama-2 style: the template writes the bos itself, and reads a kwarg (as Qwen3's enable_thinking)
BOS_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{% if enable_thinking %}<think>{% else %}ANSWER:{% endif %}{% endif %}")
MESSAGES = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi! How"},
            {"role": "user", "content": "What's 2+2?"}]


@pytest.fixture(scope="module")
def tokenizers(tiny_llama):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_llama), load_tokenizer(tiny_llama)


def hf_ids(hf, messages, **kwargs) -> list[int]:
    out = hf.apply_chat_template(messages, chat_template=BOS_TEMPLATE, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("kwargs", [dict(add_generation_prompt=True), dict(add_generation_prompt=False),
                                    dict(add_generation_prompt=True, enable_thinking=True)],
                         ids=["generation-prompt", "no-generation-prompt", "template-kwarg"])
def test_token_ids_equal_transformers_with_one_bos(tokenizers, kwargs):
    hf, ours = tokenizers
    expected = hf_ids(hf, MESSAGES, **kwargs)
    template_kwargs = {k: v for k, v in kwargs.items() if k != "add_generation_prompt"}
    got = ours.apply_chat_template(MESSAGES, kwargs["add_generation_prompt"], chat_template=BOS_TEMPLATE,
                                   template_kwargs=template_kwargs, tokenize=True)
    assert got == expected
    assert got.count(ours.bos_token_id) == 1 and got[0] == ours.bos_token_id
    # the old way (text, then encode with special tokens) doubles the bos: what this replaces
    text = ours.apply_chat_template(MESSAGES, kwargs["add_generation_prompt"], chat_template=BOS_TEMPLATE,
                                    template_kwargs=template_kwargs)
    assert ours.encode(text)[:2] == [ours.bos_token_id] * 2


def test_continue_final_message_equals_transformers(tokenizers):
    hf, ours = tokenizers
    messages = MESSAGES[:2]
    expected = hf_ids(hf, messages, continue_final_message=True)
    got = ours.apply_chat_template(messages, False, continue_final_message=True, chat_template=BOS_TEMPLATE,
                                   tokenize=True)
    assert got == expected
    assert ours.decode(got).endswith("Hi! How")           # no eos after the open message
    with pytest.raises(RequestError, match="cannot both be true"):
        ours.apply_chat_template(messages, True, continue_final_message=True, chat_template=BOS_TEMPLATE)


def test_reserved_template_kwargs_are_refused(tokenizers):
    _, ours = tokenizers
    with pytest.raises(RequestError, match="may not set messages"):
        ours.apply_chat_template(MESSAGES, template_kwargs={"messages": []})


def test_load_chat_template_from_a_file_or_inline(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(BOS_TEMPLATE, encoding="utf-8")
    assert load_chat_template(str(path)) == BOS_TEMPLATE
    assert load_chat_template(BOS_TEMPLATE) == BOS_TEMPLATE
    with pytest.raises(ConfigError, match="is not a file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ConfigError, match="--chat-template does not parse"):
        load_chat_template("{% for m in messages %}")
    assert {"messages", "bos_token", "enable_thinking"} <= template_variables(BOS_TEMPLATE)
