"""Follow-ups of a review of the tokenizer fixes (test_detok_review.py): transformers' behaviour where the first
fixes went further than it does, or missed a case."""

from __future__ import annotations

import json
import os

import pytest

from kvfit.text.tokenizer import Tokenizer, rebuilt_as_qwen2
from tiny_models import BOS, EOS, UNK, train_tokenizer


def _folder(tmp_path, config: dict, model_type: str = "llama", mutate=None) -> str:
    backend = train_tokenizer(add_bos=False)
    backend.add_tokens(["<tool>"])                   # a plain added token
    folder = str(tmp_path)
    state = json.loads(backend.to_str())
    if mutate is not None:
        mutate(state)
    with open(os.path.join(folder, "tokenizer.json"), "w") as fh:
        json.dump(state, fh)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as fh:
        json.dump({"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, **config}, fh)
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump({"model_type": model_type, "vocab_size": backend.get_vocab_size() + 8}, fh)
    return folder


@pytest.mark.parametrize("key", ["additional_special_tokens", "extra_special_tokens"])
def test_an_extra_special_token_held_as_a_plain_added_token_stays_plain(tmp_path, key):
    """transformers 5.25 keeps tokenizer.json's flag for an extra special token it holds (decode shows it)."""
    from transformers import AutoTokenizer
    folder = _folder(tmp_path, {key: ["<tool>"]})
    ours, hf = Tokenizer.from_folder(folder), AutoTokenizer.from_pretrained(folder)
    ids = ours.encode("a<tool>b", add_special_tokens=False)
    assert ids == hf("a<tool>b", add_special_tokens=False)["input_ids"]
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_truncation_and_padding_in_tokenizer_json_are_not_applied(tmp_path):
    from transformers import AutoTokenizer

    def truncate(state):
        state["truncation"] = {"direction": "Right", "max_length": 5, "strategy": "LongestFirst", "stride": 0}
        state["padding"] = {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None,
                            "pad_id": 0, "pad_type_id": 0, "pad_token": UNK}
    folder = _folder(tmp_path, {}, mutate=truncate)
    text = "the quick brown fox jumps over the lazy dog " * 3
    assert Tokenizer.from_folder(folder).encode(text) == AutoTokenizer.from_pretrained(folder)(text)["input_ids"]


def test_which_folders_transformers_rebuilds_as_qwen2():
    assert rebuilt_as_qwen2("qwen2", "TokenizersBackend") and rebuilt_as_qwen2("qwen2", None)
    assert rebuilt_as_qwen2("qwen3", None) and not rebuilt_as_qwen2("qwen3", "PreTrainedTokenizerFast")
    assert rebuilt_as_qwen2("llama", "Qwen2TokenizerFast") and not rebuilt_as_qwen2("llama", None)


def test_a_qwen2_class_on_another_model_type_encodes_as_transformers(tmp_path):
    from transformers import AutoTokenizer
    folder = _folder(tmp_path, {"tokenizer_class": "Qwen2Tokenizer"})
    text = "call 555-1234 now, isn't it?"
    assert Tokenizer.from_folder(folder).encode(text) == AutoTokenizer.from_pretrained(folder)(text)["input_ids"]


def test_structured_outputs_leave_out_tokens_appended_past_the_model(tmp_path):
    """A special token transformers appends past config.json's vocab_size (here mask_token) is never sampled;
    llguidance is built without it instead of refusing the tokenizer."""
    from kvfit.structured.tokenizer_info import build_ll_tokenizer
    folder = _folder(tmp_path, {"mask_token": "[MASK]"})
    tok = Tokenizer.from_folder(folder)
    vocab = tok.backend.get_vocab_size(with_added_tokens=True) - 1       # [MASK] is the last id, past the model
    eos = tok.backend.token_to_id(EOS)
    assert build_ll_tokenizer(tok.backend, vocab, [eos]) is not None
