"""RequestOutput: what a caller sees of one request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """text and token_ids hold the generated part only."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None       # stop | length | abort | error (non-finite logits)
    num_cached_tokens: int = 0
