"""SamplingParams: how one request picks its tokens and when it stops. Validated at construction.

A contract type: the engine admits requests with it and the runner samples with it, so it lives
below both. Every error names the field at fault (RequestError.param).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvfit.errors import RequestError

# Below this a softmax over logits / temperature overflows to inf; 0 means greedy.
MIN_SAMPLING_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 or -1 disables top-k; top_p 1.0 disables top-p."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int | None = 16
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not isinstance(self.stop, (list, tuple, type(None))):
            raise RequestError("stop must be a string or a list of strings", "stop")
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise RequestError("stop_token_ids must be a list of non-negative integers", "stop_token_ids")
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if (not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool)
                or not math.isfinite(self.temperature) or self.temperature < 0):
            raise RequestError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}", "temperature")
        if 0 < self.temperature < MIN_SAMPLING_TEMPERATURE:
            raise RequestError(f"temperature must be 0 (greedy) or >= {MIN_SAMPLING_TEMPERATURE}, "
                               f"got {self.temperature!r}", "temperature")
        if any(not isinstance(s, str) for s in self.stop):
            raise RequestError("stop must be a string or a list of strings", "stop")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise RequestError("stop_token_ids must be non-negative integers", "stop_token_ids")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if (not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1
                or self.top_k >= 2**31):
            raise RequestError(f"top_k must be -1 or 0 (off) or a positive integer below 2**31, got {self.top_k!r}",
                               "top_k")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool)
                                            or self.max_tokens < 1):
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise RequestError(f"seed must be an integer, got {self.seed!r}", "seed")
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(f"ignore_eos must be true or false, got {self.ignore_eos!r}", "ignore_eos")
        if any(not s for s in self.stop):
            raise RequestError("stop strings must be non-empty", "stop")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
