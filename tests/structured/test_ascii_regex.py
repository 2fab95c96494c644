"""Regex constraints read \\d and \\w as ASCII (vLLM's default backend): `[a-c]{3}-\\d\\d` gave 'cba-4᮸'."""

from __future__ import annotations

import re

import pytest

from kvfit.structured import StructuredOutputs, StructuredOutputsParams as Params
from kvfit.structured.ascii_regex import ascii_classes
from kvfit.text.tokenizer import Tokenizer
from tiny_models import BOS, EOS, UNK, train_tokenizer


@pytest.mark.parametrize("regex, ascii", [
    (r"[a-c]{3}-\d\d", "[a-c]{3}-[0-9][0-9]"), (r"\w+\W", "[0-9A-Za-z_]+[^0-9A-Za-z_]"), (r"[\d.]+\D", "[0-9.]+[^0-9]"),
    (r"\\d", r"\\d"), (r"[^\]\d]", r"[^\]0-9]"), (r"[]\w]", "[]0-9A-Za-z_]"), (r"a\.b\s", r"a\.b\s")])
def test_classes_are_rewritten_and_escapes_kept(regex, ascii):
    assert ascii_classes(regex) == ascii
    assert re.compile(ascii)       # still a regex


def test_a_non_ascii_digit_is_refused_by_the_matcher():
    tok = Tokenizer(train_tokenizer(), {"eos_token": EOS, "bos_token": BOS, "unk_token": UNK})
    so = StructuredOutputs(tok, tok.vocab_size)

    def accepts(text: str) -> bool:
        matcher = so.matcher(Params(regex=r"[a-c]{3}-\d\d"), ())
        return all(matcher.accept(t) for t in tok.encode(text, add_special_tokens=False))

    assert accepts("cba-42")
    assert not accepts("cba-4\u1bb8")      # SUNDANESE DIGIT EIGHT: a Unicode \d, not an ASCII one
    assert not accepts("cba-\u0664\u0662")  # Arabic-Indic digits
