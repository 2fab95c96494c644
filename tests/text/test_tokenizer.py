"""Tokenizer: the same ids, text and chat prompts as transformers' AutoTokenizer on the same folder."""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest

from kvfit.errors import ConfigError, RequestError
from kvfit.text.tokenizer import load_tokenizer
from tiny_models import CORPUS

TEXTS = CORPUS.splitlines() + [
    "", " ", "Numbers 2024 and 12345, I'm you're can't   triple   spaces\n\nnewlines\ttabs",
    "special tokens inline: <s> x </s> <unk>", "émoji 🙂 and ÅÄÖ", "HELLO World 3.14"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "What's 2+2?"}]
FIXTURES = ["tiny_llama", "tiny_qwen2", "tiny_qwen3"]


@pytest.mark.parametrize("fixture", FIXTURES)
def test_encode_and_decode_match_autotokenizer(fixture, request):
    from transformers import AutoTokenizer
    folder = request.getfixturevalue(fixture)
    hf, ours = AutoTokenizer.from_pretrained(folder), load_tokenizer(folder)
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special), text
    rng = random.Random(0)
    for _ in range(100):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randint(0, 30))]
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), ids
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids), ids
    assert ours.eos_token_id == hf.eos_token_id == 2
    assert ours.bos_token_id == hf.bos_token_id


def test_bos_follows_the_tokenizer_config(tiny_llama, tiny_qwen2):
    assert load_tokenizer(tiny_llama).encode("Hello")[0] == 1
    assert load_tokenizer(tiny_llama).encode("Hello", add_special_tokens=False)[0] != 1
    assert load_tokenizer(tiny_qwen2).encode("Hello")[0] != 1


@pytest.mark.parametrize("fixture", FIXTURES)
def test_chat_template_matches_transformers(fixture, request):
    from transformers import AutoTokenizer
    folder = request.getfixturevalue(fixture)
    hf, ours = AutoTokenizer.from_pretrained(folder), load_tokenizer(folder)
    for gen in (True, False):
        expected = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt=gen) == expected
    assert ours.apply_chat_template(MESSAGES).endswith("<|assistant|>\n")


def _with_template(src: str, dst, template: str, as_jinja_file: bool = False) -> str:
    folder = str(dst / "templated")
    shutil.copytree(src, folder)
    path = os.path.join(folder, "tokenizer_config.json")
    cfg = json.load(open(path))
    if as_jinja_file:
        cfg.pop("chat_template")
        open(os.path.join(folder, "chat_template.jinja"), "w").write(template)
    else:
        cfg["chat_template"] = template
    json.dump(cfg, open(path, "w"))
    return folder


RICH_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('roles must alternate') }}{% endif %}"
    "{% if loop.index0 > 5 %}{% break %}{% endif %}"
    "[{{ m['role'] | upper }}] {{ m['content'] | trim }}{% if not loop.last %}{{ eos_token }}{% endif %}\n"
    "{% endfor %}{{ messages | tojson }}{% if add_generation_prompt %}[ASSISTANT]{% endif %}")


@pytest.mark.parametrize("as_jinja_file", [False, True])
def test_a_richer_template_renders_like_transformers(tiny_llama, tmp_path, as_jinja_file):
    from transformers import AutoTokenizer
    folder = _with_template(tiny_llama, tmp_path, RICH_TEMPLATE, as_jinja_file)
    hf, ours = AutoTokenizer.from_pretrained(folder), load_tokenizer(folder)
    chat = [{"role": "user", "content": " héllo <b> "}, {"role": "assistant", "content": "hi"}]
    expected = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(chat) == expected and expected.startswith("<s>[USER] héllo <b></s>")
    with pytest.raises(RequestError, match="roles must alternate"):
        ours.apply_chat_template([{"role": "assistant", "content": "first"}])


def test_no_chat_template_is_a_config_error(tmp_path):
    from tiny_models import make_tiny_model
    folder = make_tiny_model(tmp_path, arch="qwen3", with_chat_template=False, vocab_size=280)
    tok = load_tokenizer(folder)
    assert tok.chat_template is None
    with pytest.raises(ConfigError, match="no chat_template"):
        tok.apply_chat_template(MESSAGES)


def test_a_template_that_does_not_parse_is_a_config_error(tiny_llama, tmp_path):
    tok = load_tokenizer(_with_template(tiny_llama, tmp_path, "{% for m in messages %}"))
    with pytest.raises(ConfigError, match="does not parse"):
        tok.apply_chat_template(MESSAGES)


def test_no_tokenizer_json_means_no_tokenizer(tmp_path):
    assert load_tokenizer(str(tmp_path)) is None
