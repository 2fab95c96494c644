"""RequestOutput and the detokenizer that applies stop strings."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """What a caller sees of one request; text and token_ids hold the generated part only."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None       # stop | length | abort
    num_cached_tokens: int = 0


class Detokenizer:
    """Keeps each request's text; finds stop strings (which are left out of the text)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def text(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(token_ids)
        # a multi-byte character still incomplete: hold it back until its last token arrives
        return text[:-1] if text.endswith("\ufffd") else text

    @staticmethod
    def find_stop(text: str, stops: tuple[str, ...]) -> int | None:
        """Index where the earliest stop string begins in text, or None."""
        best = None
        for stop in stops:
            at = text.find(stop)
            if at != -1 and (best is None or at < best):
                best = at
        return best
