"""IncrementalDetokenizer: the same text as decoding the whole output, cut at the first stop string that completes
(of two completing at one token, the first listed, as vLLM).

Four tokenizers trained here, one per decoder family that changes text across token boundaries:
- byte_level: GPT-2/Qwen style byte-level BPE; random ids split characters (emoji, CJK, accents).
- metaspace: sentencepiece-style Unigram ("▁" becomes a space, the first one is stripped) with
  clean_up_tokenization_spaces, so " ." and " n't" lose their space across tokens.
- byte_fallback: Llama-2 style BPE with <0xXX> byte tokens and Replace/ByteFallback/Fuse/Strip.
- wordpiece: BERT style ("##" joins, others get a space) with the clean-up.
Each has special tokens in its vocab, which decode skips, and an added token "<tool>", which it keeps.
"""

from __future__ import annotations


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfit.text.detokenizer import IncrementalDetokenizer, _is_safe_cut, _stop_prefix_len, clean_up
from kvfit.text.tokenizer import CLEANUPS, Tokenizer
from tiny_models import CORPUS, train_byte_fallback_tokenizer

SPECIALS = ["<unk>", "<s>", "</s>", "<|im_end|>"]
TEXT = CORPUS + """\
Emoji 🙂🚀👍🏽 and accents: café naïve Ångström crème brûlée. Ελληνικά και русский текст.
CJK: 東京は晴れ。日本語のテキスト、中文文本。한국어 텍스트.
Don't stop ! ok . what ? it 's fine , we 're here and they 've gone ; x ' y n't
"""
LINES = TEXT.splitlines() * 4
SHORT_STOPS = (" ", ".", " .", "'s", "e", "\ufffd", "t ", ",", "\n")


def _wrap(backend, clean_up_spaces: bool = False) -> Tokenizer:
    backend.add_tokens(["<tool>"])          # an added token decode keeps
    return Tokenizer(backend, {"unk_token": SPECIALS[0], "eos_token": SPECIALS[2],
                               "clean_up_tokenization_spaces": clean_up_spaces})


def _byte_level() -> Tokenizer:
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers
    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(LINES, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return _wrap(tok)


def _metaspace() -> Tokenizer:
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers
    tok = Backend(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(LINES, trainers.UnigramTrainer(
        vocab_size=300, special_tokens=SPECIALS, unk_token=SPECIALS[0], show_progress=False))
    return _wrap(tok, clean_up_spaces=True)


def _byte_fallback() -> Tokenizer:
    return _wrap(train_byte_fallback_tokenizer(LINES, SPECIALS))


def _wordpiece() -> Tokenizer:
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers
    tok = Backend(models.WordPiece(unk_token=SPECIALS[0]))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(LINES, trainers.WordPieceTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                             show_progress=False))
    return _wrap(tok, clean_up_spaces=True)


BUILDERS = {"byte_level": _byte_level, "metaspace": _metaspace, "byte_fallback": _byte_fallback,
            "wordpiece": _wordpiece}


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Tokenizer]:
    return {name: build() for name, build in BUILDERS.items()}


def expected_text(tok: Tokenizer, ids: list[int], stops: tuple[str, ...]) -> str:
    """The oracle: decode everything (fed up to the token a stop completed at), cut at the first stop string in
    the request's order that the text holds (vLLM's check_stop_strings: no stop was in the text a token before)."""
    full = tok.decode(ids)
    hits = [at for at in (full.find(stop) for stop in stops) if at != -1]
    return full[:hits[0]] if hits else full


def feed(tok: Tokenizer, ids: list[int], stops: tuple[str, ...] = ()):
    """Add ids until a stop matches; (detokenizer, ids fed, stop matched, deltas streamed, texts seen)."""
    detok = IncrementalDetokenizer(tok, stops)
    deltas, texts, matched, fed = [], [], None, []
    for token_id in ids:
        fed.append(token_id)
        matched = detok.add(token_id)
        deltas.append(detok.new_text())
        texts.append(detok.text)
        if matched is not None:
            break
    return detok, fed, matched, deltas, texts


# the oracle on random and natural id sequences ------------------------------------------------
@st.composite
def ids_and_stops(draw, tok: Tokenizer):
    if draw(st.booleans()):
        ids = draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=40))
    else:                      # natural text: stops and clean-up patterns actually occur
        text = draw(st.text(alphabet=sorted(set(TEXT)), max_size=60))
        ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids)
    stops = []
    for _ in range(draw(st.integers(0, 3))):
        if full and draw(st.booleans()):    # a piece of the text: it will match
            start = draw(st.integers(0, len(full) - 1))
            stops.append(full[start:draw(st.integers(start + 1, min(len(full), start + 6)))])
        else:                               # spaces, clean-up patterns, the replacement char
            stops.append(draw(st.sampled_from(SHORT_STOPS)))
    return ids, tuple(stops)


@pytest.mark.parametrize("name", list(BUILDERS))
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_matches_the_whole_decode_cut_at_the_first_listed_stop(tokenizers, name, data):
    tok = tokenizers[name]
    ids, stops = data.draw(ids_and_stops(tok))
    detok, fed, matched, deltas, texts = feed(tok, ids, stops)
    final = detok.final_text()
    deltas.append(detok.new_text())
    assert final == expected_text(tok, fed, stops)
    assert "".join(deltas) == final            # streaming never hands out a stop's start
    full = tok.decode(fed)
    assert all(full.startswith(text) for text in texts)
    growing = texts[:-1] if matched is not None else texts      # a stop cuts the last one
    assert all(later.startswith(text) for text, later in zip(growing, growing[1:]))
    if matched is not None:
        assert texts[-1] == final and full[len(final):].startswith(matched)
        # found as soon as the decoded text holds it, not a token later
        assert expected_text(tok, fed[:-1], stops) == tok.decode(fed[:-1])
    else:
        assert fed == ids and final == full


CLEAN_UP_ALPHABET = " .?!,'ntmsverab"


@given(left=st.text(alphabet=CLEAN_UP_ALPHABET, max_size=8), right=st.text(alphabet=CLEAN_UP_ALPHABET, max_size=8))
@settings(max_examples=500)
def test_a_safe_cut_splits_the_clean_up(left, right):
    if _is_safe_cut(left):
        assert clean_up(left + right) == clean_up(left) + clean_up(right)


def test_clean_up_patterns_only_delete_spaces():
    # _is_safe_cut's argument: a pattern starts with a space and its replacement is it minus spaces
    for before, after in CLEANUPS:
        assert before.startswith(" ") and before.replace(" ", "") == after.replace(" ", "")
        assert len(after) < len(before)


# behaviours one at a time ---------------------------------------------------------------------
def _ids_of(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_first_token_keeps_the_whole_decodes_leading_space_rule(tokenizers):
    tok = tokenizers["metaspace"]
    ids = _ids_of(tok, "Hello world")
    assert tok.backend.id_to_token(ids[0]).startswith("▁")
    detok, *_ = feed(tok, ids)
    assert detok.final_text() == tok.decode(ids) == "Hello world"


def test_context_that_decodes_to_nothing_is_not_an_anchor(tokenizers):
    # with Strip(start=2), "▁" alone decodes to "" and "▁▁y" to "y": a window starting at that "▁"
    # would lose the space decoded right after it, so the window keeps the token before it
    from tokenizers import Tokenizer as Backend, decoders
    backend = Backend.from_str(tokenizers["byte_fallback"].backend.to_str())
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 2, 0)])
    tok = _wrap(backend)
    ids = [backend.token_to_id(t) for t in ("x", "▁", "▁", "y")]
    detok, *_ = feed(tok, ids)
    assert detok.final_text() == tok.decode(ids) == "x  y"


def test_split_character_is_held_back_until_complete(tokenizers):
    tok = tokenizers["byte_level"]
    alphabet = _byte_alphabet()
    ids = [tok.backend.token_to_id(alphabet[byte]) for byte in "🙂".encode()]     # one token per byte
    detok = IncrementalDetokenizer(tok)
    for token_id in ids[:-1]:
        assert detok.add(token_id) is None
        assert detok.text == "" and detok.new_text() == ""
    detok.add(ids[-1])
    assert detok.text == "🙂" and detok.new_text() == "🙂"


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable char map, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def test_clean_up_space_waits_for_the_next_token(tokenizers):
    tok = tokenizers["metaspace"]
    ids = _ids_of(tok, "ok . what")
    detok, *_ = feed(tok, ids)
    assert detok.final_text() == tok.decode(ids) == "ok. what"
    detok = IncrementalDetokenizer(tok)
    detok.add(ids[0])
    assert " " not in detok.text           # "ok" then " ": the space may still vanish before "."


def test_stop_spanning_tokens_is_left_out_and_ends_the_text(tokenizers):
    tok = tokenizers["byte_level"]
    ids = _ids_of(tok, "The quick brown fox jumps")
    detok = IncrementalDetokenizer(tok, ("own f", "zzz"))
    matched = None
    for token_id in ids:
        matched = detok.add(token_id)
        if matched:
            break
    assert matched == "own f"
    assert detok.text == detok.final_text() == "The quick br"
    with pytest.raises(AssertionError):
        detok.add(ids[0])


def test_new_text_holds_back_a_possible_stop_start_until_ruled_out(tokenizers):
    tok = tokenizers["byte_level"]
    detok = IncrementalDetokenizer(tok, ("brown cow",))
    streamed = ""
    for token_id in _ids_of(tok, "The quick brown"):
        assert detok.add(token_id) is None
        streamed += detok.new_text()
    assert detok.text == "The quick brown" and streamed == "The quick "
    for token_id in _ids_of(tok, " fox"):
        detok.add(token_id)
    assert streamed + detok.new_text() == "The quick brown fox"


def test_final_text_releases_the_held_tail(tokenizers):
    tok = tokenizers["byte_level"]
    detok = IncrementalDetokenizer(tok, ("lazy dogs",))
    for token_id in _ids_of(tok, "the lazy dog"):
        detok.add(token_id)
    assert detok.new_text() == "the "
    assert detok.final_text() == "the lazy dog"
    assert detok.new_text() == "lazy dog"


def test_stop_prefix_len_takes_the_longest_suffix():
    stops = ("abcd", "cx")
    first = frozenset("ac")
    assert _stop_prefix_len("zabc", stops, first) == 3
    assert _stop_prefix_len("zzc", stops, first) == 1
    assert _stop_prefix_len("zzz", stops, first) == 0


def test_no_tokenizer_keeps_an_empty_text():
    detok = IncrementalDetokenizer(None)
    assert detok.add(5) is None
    assert detok.text == detok.new_text() == detok.final_text() == ""
    with pytest.raises(AssertionError):
        IncrementalDetokenizer(None, ("stop",))


# cost: the decoded window does not grow with the output ------------------------------------------
class _CountingBackend:
    """A tokenizers.Tokenizer that records the longest id list each decode call gets."""

    def __init__(self, backend):
        self._backend = backend
        self.max_ids = 0

    def decode(self, ids, skip_special_tokens=True):
        self.max_ids = max(self.max_ids, len(ids))
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id):
        return self._backend.id_to_token(token_id)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_each_token_decodes_a_short_window(tokenizers, name):
    tok = tokenizers[name]
    ids = _ids_of(tok, TEXT * 5)
    counting = _CountingBackend(tok.backend)
    detok = IncrementalDetokenizer(tok, ("\n\nUser:",))
    detok._window._backend = counting
    for token_id in ids:
        detok.add(token_id)
        detok.new_text()
    assert len(ids) > 1000 and counting.max_ids <= 12
    assert detok.final_text() == tok.decode(ids)


def test_of_two_stops_completing_at_one_token_the_first_listed_wins(tokenizers):
    """vLLM's check_stop_strings goes through the stops in the request's order: where one token completes two, the
    text is cut at the one listed first, even if the other begins earlier."""
    tok = tokenizers["byte_level"]
    ids = tok.encode(" the", add_special_tokens=False)
    assert len(ids) == 1 and tok.decode(ids) == " the"          # one token completes both stops below
    for stops, text, matched in (((" th", "he"), "", " th"), (("he", " th"), " t", "he")):
        detok, _, got, _, _ = feed(tok, ids, stops)
        assert (detok.final_text(), got) == (text, matched)
