"""IncrementalDetokenizer: one request's output text, built token by token, with stop strings.

The text is the same as `tokenizer.decode(output_ids)` (cut before the first stop string that completes; of two
that complete at the same token, the one listed first, as vLLM), but each
token costs O(1) amortised instead of a decode of the whole output. Three layers, each holding back
the end of its text that a later token could still change:

1. `_WindowDecoder`: the backend's decode (special tokens skipped, before the clean-up). Only a window
   of recent ids is decoded (vLLM's prefix_offset/read_offset idea): ids[prefix_offset:read_offset] are
   left context whose text was already released, so the decoder's left-edge effects (a metaspace or
   Strip decoder dropping the first space, WordPiece's first "##") fall on that context; the new text
   is the window's text past the context's text. Held back: an incomplete character (the text ends in
   U+FFFD), a trailing byte-fallback token ("<0xE4>": the run of byte tokens may still turn invalid).
2. The clean-up transformers applies when clean_up_tokenization_spaces is set (" ." -> "."): raw text
   is cleaned only up to a cut where no clean-up pattern can straddle (`_last_safe_cut`).
3. Stop strings: searched in the new text plus the max_stop_chars - 1 characters before it, and in the
   held-back tail as decoded now (the text the request would end with if it ended here).

Invariants:
- `text` is a prefix of the decode of every longer id sequence; it only grows until a stop string
  matches, which cuts it before the stop (the stop may have begun in it).
- what `new_text()` handed out never contains the start of a stop string matched later.
- the window decoder's context text is non-empty or starts at the output's first token, so a
  left-edge effect never reaches the new text.
"""

from __future__ import annotations

from kvfit.text.tokenizer import CLEANUPS

INCOMPLETE_CHAR = "\ufffd"       # what a lossy UTF-8 decode yields for a character still missing bytes
# the clean-up's patterns all start with a space and only delete spaces, so a cut that no pattern can
# straddle is one whose left side ends in a char no pattern holds, or has no space in its last few chars
_CLEANUP_CHARS = frozenset("".join(before for before, _ in CLEANUPS))
_CLEANUP_MAX_CHARS = max(len(before) for before, _ in CLEANUPS)


def clean_up(text: str) -> str:
    """The Tokenizer's clean-up (clean_up_tokenization_spaces), applied in the same order."""
    for before, after in CLEANUPS:
        text = text.replace(before, after)
    return text


def _is_safe_cut(left: str) -> bool:
    """clean_up(left + right) == clean_up(left) + clean_up(right) for every right.

    A match that straddles the cut starts with a space in left (deletions never move a non-space char)
    and holds left's last char, which survives every pass; so it needs left[-1] to be a pattern char and
    a space among left's last _CLEANUP_MAX_CHARS - 1 chars.
    """
    return not left or left[-1] not in _CLEANUP_CHARS or " " not in left[1 - _CLEANUP_MAX_CHARS:]


def _last_safe_cut(text: str) -> int:
    """The largest i with _is_safe_cut(text[:i]) (0 always is)."""
    for end in range(len(text), 0, -1):
        if _is_safe_cut(text[max(0, end - _CLEANUP_MAX_CHARS):end]):
            return end
    return 0


def _first_listed_stop(text: str, stops: tuple[str, ...], new_from: int = 0) -> tuple[int, str] | None:
    """(index, stop) of the first stop string in the request's order that text holds ending past new_from (in the
    new text), at its first such occurrence, or None: vLLM's check_stop_strings (where two stop strings complete at
    the same token, the one listed first wins, not the one that begins first; a stop wholly in text that was
    there before, as min_tokens leaves it unchecked, is not one)."""
    for stop in stops:
        at = text.find(stop, max(new_from - len(stop) + 1, 0))
        if at != -1:
            return at, stop
    return None


def _stop_prefix_len(text: str, stops: tuple[str, ...], first_chars: frozenset[str]) -> int:
    """Length of the longest suffix of text that a stop string begins with (text holds no whole stop)."""
    if first_chars.isdisjoint(text):       # the common case, in C
        return 0
    for k in range(len(text), 0, -1):
        suffix = text[-k:]
        if suffix[0] in first_chars and any(stop.startswith(suffix) for stop in stops):
            return k
    return 0


def _last_chars(text: str, num_chars: int) -> str:
    return text[max(0, len(text) - num_chars):] if num_chars else ""


def _is_byte_token(token: str | None) -> bool:
    """A byte-fallback token such as "<0xE4>" (ByteFallback turns a run of them into text all at once)."""
    return token is not None and len(token) == 6 and token.startswith("<0x") and token.endswith(">")


class _WindowDecoder:
    """The backend's decode of every id so far (skip_special_tokens, no clean-up), grown one id at a time.

    ids[:read_offset] is released text; ids[prefix_offset:read_offset] decodes to `_context_text`, the
    left context of each window ids[prefix_offset:].
    """

    def __init__(self, backend, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True):
        self._backend = backend                 # a tokenizers.Tokenizer
        self._skip_special_tokens = skip_special_tokens
        # vLLM's spaces_between_special_tokens False (shown special tokens only): an added token right after an added
        # token is its bare content, without the space a decoder (WordPiece, WordLevel) puts between them
        self._added: dict[int, str] | None = None
        if not (skip_special_tokens or spaces_between_special_tokens):
            self._added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()} or None
        self._last_added = False
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._context_text = ""
        self._window_text = ""                  # decode(ids[prefix_offset:]) at the last add
        self._byte_run_open = False

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one id; the raw text that became stable ("" while a character is incomplete)."""
        text = self._add(token_id)
        if self._added is not None:
            content = self._added.get(token_id)
            if content is not None and self._last_added and text == " " + content:
                text = content
            self._last_added = content is not None
        return text

    def _add(self, token_id: int) -> str:
        self._ids.append(token_id)
        window = self._decode(self._ids[self._prefix_offset:])
        self._track_byte_run(token_id, window)
        self._window_text = window
        context = self._context_text
        if (self._byte_run_open or len(window) <= len(context) or window.endswith(INCOMPLETE_CHAR)
                or not window.startswith(context)):
            return ""
        new_context = self._decode(self._ids[self._read_offset:])
        if new_context:             # the next window starts at the released ids' first token
            self._prefix_offset, self._context_text = self._read_offset, new_context
        else:                       # they decode to "" alone ("▁" under a Strip): a left-edge effect
                                    # could reach past them, so keep the older context too
            self._context_text = window
        self._window_text = self._context_text
        self._read_offset = len(self._ids)
        return window[len(context):]

    def _track_byte_run(self, token_id: int, window: str) -> None:
        """Whether the ids end in a run of byte-fallback tokens, which ByteFallback decodes as a whole.

        A skipped special token leaves the decode unchanged and does not end the run (the decoder never
        sees it); any other token that changes the text does.
        """
        if _is_byte_token(self._backend.id_to_token(token_id)):
            self._byte_run_open = True
        elif window != self._window_text:       # _window_text: the same window before this id
            self._byte_run_open = False

    def pending(self) -> str:
        """Raw text of the ids not yet released, as decoded now (may end in an incomplete character)."""
        return self._window_text[len(self._context_text):]


class IncrementalDetokenizer:
    """One request's output text, built token by token."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True,
                 include_stop_str_in_output: bool = False, spaces_between_special_tokens: bool = True) -> None:
        """tokenizer: a kvfit Tokenizer, or None (then the text stays "" and stop must be empty).
        include_stop_str_in_output: a matched stop string stays in the text (cut after it, not before).

        No prompt context: the text is the decode of the output ids alone, whose first window starts
        at the output's first token exactly as that decode does (prompt context would turn a stripped
        "Hello" into " Hello").
        """
        assert tokenizer is not None or not stop, "stop strings need a tokenizer"
        assert all(stop), "stop strings must be non-empty (SamplingParams checks)"
        self._window = None if tokenizer is None else _WindowDecoder(tokenizer.backend, skip_special_tokens,
                                                                     spaces_between_special_tokens)
        self._include_stop = include_stop_str_in_output
        self._clean = tokenizer is not None and tokenizer.cleans_up_spaces
        self._stops = tuple(stop)
        self._stop_first_chars = frozenset(s[0] for s in self._stops)
        self._context_chars = max(map(len, self._stops), default=1) - 1   # where a stop could have begun
        self._raw_tail = ""             # raw text the clean-up could still change
        self._pieces: list[str] = []    # the committed text (`text`), in pieces: no O(n) copy per token
        self._num_pieces_joined = 0
        self._joined = ""
        self._recent = ""               # the committed text's last _context_chars chars
        self._unreleased: list[str] = []    # committed text new_text() has not handed out
        self._final: str | None = None      # the whole text, once a stop matched or final_text() ran
        self._num_released_chars = 0

    # adding tokens ------------------------------------------------------------------------------
    def add(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append one token; the stop string that matched (the request must finish), else None.
        check_stop False: the token's text is added but no stop string is looked for (min_tokens)."""
        assert self._final is None, "add() after the request's text was finished"
        if self._window is None:
            return None
        committed = self._commit(self._window.add(token_id))
        before = self._recent
        if committed:
            self._pieces.append(committed)
            self._unreleased.append(committed)
            self._recent = _last_chars(before + committed, self._context_chars)
        return self._find_stop(before, committed) if self._stops and check_stop else None

    def _commit(self, raw: str) -> str:
        """Clean raw text up to the last cut no clean-up pattern can straddle; keep the rest."""
        if not self._clean:
            return raw
        tail = self._raw_tail + raw
        cut = _last_safe_cut(tail)
        self._raw_tail = tail[cut:]
        return clean_up(tail[:cut])

    def _tail(self) -> str:
        """The text past `text` as it would end if the request ended now (bounded by the hold-backs)."""
        if self._window is None:
            return ""
        pending = self._window.pending()
        return clean_up(self._raw_tail + pending) if self._clean else pending

    def _find_stop(self, before: str, committed: str) -> str | None:
        """Search the new text, the context before it and the held-back tail; finish on a match."""
        tail = self._tail()
        match = _first_listed_stop(before + committed + tail, self._stops, len(before))
        if match is None:
            return None
        at, stop = match
        text = self.text                    # O(length), once per request: it ends here
        start = len(text) - len(committed) - len(before)       # where `before` begins in the text
        self._final = (text + tail)[:start + at + (len(stop) if self._include_stop else 0)]
        return stop

    # reading the text ---------------------------------------------------------------------------
    @property
    def text(self) -> str:
        """The stable text so far (never ends in an incomplete character); O(length) per call."""
        if self._final is not None:
            return self._final
        if self._num_pieces_joined < len(self._pieces):
            self._joined += "".join(self._pieces[self._num_pieces_joined:])
            self._num_pieces_joined = len(self._pieces)
        return self._joined

    def new_text(self) -> str:
        """Text added since the previous call, holding back a tail a stop string could still begin."""
        if self._final is not None:
            delta = self._final[self._num_released_chars:]
            self._num_released_chars = len(self._final)
            return delta
        pending = "".join(self._unreleased)
        hold = _stop_prefix_len(self._recent, self._stops, self._stop_first_chars) if self._stops else 0
        assert hold <= len(pending), "a stop prefix reaches into text already handed out"
        self._unreleased = [pending[len(pending) - hold:]] if hold else []
        self._num_released_chars += len(pending) - hold
        return pending[:len(pending) - hold]

    def final_text(self) -> str:
        """The whole text at the end of the request: `text` plus the held-back tail, cut at a stop.

        Ends the text: add() may not follow, a later new_text() hands out the rest.
        """
        if self._final is None:
            self._final = self.text + self._tail()
        return self._final
