"""Special tokens as transformers 5 adds them, per tokenizer class: with a tokenizer.json, tokenizer_config.json's
add_bos_token / add_eos_token are dropped, so tokenizer.json's post-processor decides (none: nothing is added),
except for classes whose constructor sets its own (CodeLlamaTokenizer: bos; GPTNeoXTokenizer: none).
Every tokenizer type the tests build (byte-level BPE, Qwen-style, sentencepiece-style byte fallback; with and
without a bos post-processor) against AutoTokenizer on the same folder."""

from __future__ import annotations

import functools
import itertools
import json
import os

import pytest

from kvfit.text.tokenizer import Tokenizer
from tiny_models import BOS, CORPUS, EOS, UNK, train_byte_fallback_tokenizer, train_tokenizer

TEXTS = ["Hello world", "", " the quick </s> fox <s>"]
# classes whose transformers 5 pipeline matches tokenizer.json for every kind built here
CLASSES = (None, "PreTrainedTokenizerFast", "TokenizersBackend", "LlamaTokenizerFast")
KINDS = ("bytelevel", "qwen", "sentencepiece")


@functools.lru_cache(maxsize=None)
def _tokenizer_json(kind: str, with_bos: bool) -> str:
    from tokenizers import processors
    if kind == "sentencepiece":
        tok = train_byte_fallback_tokenizer(CORPUS.splitlines())
        if with_bos:
            tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                               special_tokens=[(BOS, 1)])
    else:
        tok = train_tokenizer(add_bos=with_bos, qwen_style=kind == "qwen")
    return tok.to_str()


def _folder(tmp_path, kind, with_bos, cls, add_bos, add_eos) -> str:
    folder = tmp_path / f"{kind}-{with_bos}-{cls}-{add_bos}-{add_eos}"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(_tokenizer_json(kind, with_bos))
    config = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK}
    config.update({k: v for k, v in (("tokenizer_class", cls), ("add_bos_token", add_bos), ("add_eos_token", add_eos))
                   if v is not None})
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


def _assert_same_ids(folder: str) -> None:
    from transformers import AutoTokenizer
    hf, ours = AutoTokenizer.from_pretrained(folder), Tokenizer.from_folder(folder)
    for text, special in itertools.product(TEXTS, (True, False)):
        assert ours.encode(text, special) == hf.encode(text, add_special_tokens=special), (os.path.basename(folder), text)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("with_bos", [False, True], ids=["no-bos-post-processor", "bos-post-processor"])
def test_token_ids_equal_autotokenizer_whatever_add_bos_token_says(tmp_path, kind, with_bos):
    for cls, add_bos, add_eos in itertools.product(CLASSES, (True, False, None), (True, None)):
        _assert_same_ids(_folder(tmp_path, kind, with_bos, cls, add_bos, add_eos))


def test_the_issue_case_add_bos_token_on_a_generic_byte_level_bpe_adds_no_bos(tmp_path):
    folder = _folder(tmp_path, "bytelevel", False, "PreTrainedTokenizerFast", True, None)
    assert Tokenizer.from_folder(folder).encode("Hello")[0] != 1
    _assert_same_ids(folder)


@pytest.mark.parametrize("kind, cls", [("sentencepiece", "CodeLlamaTokenizer"), ("bytelevel", "GPTNeoXTokenizerFast")])
def test_classes_that_set_their_own_special_tokens(tmp_path, kind, cls):
    for with_bos, add_bos in itertools.product((False, True), (True, False, None)):
        _assert_same_ids(_folder(tmp_path, kind, with_bos, cls, add_bos, True))
