"""SamplingParams: how one request picks its tokens and when it stops. Validated at construction.

A contract type: the engine admits requests with it and the runner samples with it, so it lives
below both. Field names and semantics are vLLM's; every error names the field at fault
(RequestError.param). What needs the model (vocabulary bounds, tokenizing bad_words, compiling
structured_outputs, max logprobs) is checked at admission (engine/admission.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, replace

from kvfit.errors import RequestError
from kvfit.structured_params import StructuredOutputsParams

# Below this a softmax over logits / temperature overflows to inf; 0 means greedy.
MIN_SAMPLING_TEMPERATURE = 1e-5
MAX_SAMPLING_TEMPERATURE = 2.0         # vLLM's (and OpenAI's) upper bound
# vLLM's default --max-logprobs: the most top-k logprobs (and prompt logprobs) a request may ask for
# (the engine's setting is checked at admission).
MAX_LOGPROBS = 20
# OpenAI's (and vLLM's protocol's) range for a logit bias; larger values are clamped to it.
MAX_LOGIT_BIAS = 100.0
# Prompt positions whose logits are computed at once for prompt_logprobs (the runner; the estimate).
PROMPT_LOGPROBS_SLICE = 256
MAX_PENALTY = 2.0           # presence_penalty and frequency_penalty lie in [-2, 2] (OpenAI, vLLM)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# fields whose value is a number (an int is one) or an integer; a value of another type is named as such
_NUMBER_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
_INT_FIELDS = ("top_k", "n", "min_tokens", "max_tokens", "seed", "logprobs", "prompt_logprobs")


def as_python(value):
    """A numpy or torch scalar or array as Python values (a scalar's item, an array's nested list), converted
    once where a value enters kvfit (vLLM accepts them); lists, tuples and dicts converted element-wise;
    anything else as it is."""
    module = type(value).__module__.partition(".")[0]
    if module in ("numpy", "torch") and hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        converted = [as_python(v) for v in value]
        return converted if isinstance(value, list) else tuple(converted)
    if isinstance(value, dict):
        return {as_python(k): as_python(v) for k, v in value.items()}
    return value


def _type_name(value) -> str:
    return f"{type(value).__name__} {value!r:.40}"


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {value!r}", name)


def _token_id_list(name: str, value) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or any(not _is_int(t) or t < 0 for t in value):
        raise RequestError(f"{name} must be a list of non-negative token ids", name)
    return tuple(value)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 or -1 disables top-k; top_p 1.0 disables top-p; min_p 0 disables min-p.

    Penalties (vLLM's and OpenAI's semantics): presence_penalty subtracts once from every token the
    output holds, frequency_penalty once per occurrence; repetition_penalty (transformers') divides
    positive logits and multiplies negative ones of every token in the prompt or the output.
    logprobs: how many top log probabilities to return per output token (the sampled token's always
    comes too); prompt_logprobs: the same for every prompt token. Both are the model's raw fp32
    log-softmax, before temperature, penalties and every other processing but a structured output's mask
    (vLLM's default logprobs_mode, raw_logprobs; vLLM masks the logits first). n: independent samples of the prompt (a seeded request gives
    sample i the seed + i, as vLLM does).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int | None = 16
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = field(default_factory=tuple)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (str, bool, int, float, type(None), StructuredOutputsParams)):
                object.__setattr__(self, f.name, as_python(value))
        # vLLM's readings: seed -1 is no seed; logprobs / prompt_logprobs True are 1
        if _is_int(self.seed) and self.seed == -1:
            object.__setattr__(self, "seed", None)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is True:
                object.__setattr__(self, name, 1)
        self._check_types()
        self._check_stops()
        self._check_sampling()
        self._check_lengths()
        self._check_penalties()
        self._check_logprobs()
        self._check_token_edits()
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens", "detokenize"):
            _check_bool(name, getattr(self, name))
        if self.stop and not self.detokenize:
            raise RequestError("stop strings need detokenize=True (the text); use stop_token_ids", "stop")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise RequestError("structured_outputs must be a StructuredOutputsParams, got "
                               f"{type(self.structured_outputs).__name__}", "structured_outputs")

    def _check_types(self) -> None:
        """A value of the wrong type is named as such (not as out of range)."""
        for name in _NUMBER_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise RequestError(f"{name} must be a number, got {_type_name(value)}", name)
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise RequestError(f"{name} must be an integer, got {_type_name(value)}", name)

    def _check_stops(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not isinstance(self.stop, (list, tuple, type(None))):
            raise RequestError("stop must be a string or a list of strings", "stop")
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise RequestError("stop_token_ids must be a list of non-negative integers", "stop_token_ids")
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if any(not isinstance(s, str) for s in self.stop):
            raise RequestError("stop must be a string or a list of strings", "stop")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise RequestError("stop_token_ids must be non-negative integers", "stop_token_ids")
        if any(not s for s in self.stop):
            raise RequestError("stop strings must be non-empty", "stop")

    def _check_sampling(self) -> None:
        if not _is_number(self.temperature) or not 0 <= self.temperature <= MAX_SAMPLING_TEMPERATURE:
            raise RequestError(f"temperature must be in [0, {MAX_SAMPLING_TEMPERATURE:g}] (0 = greedy), got "
                               f"{self.temperature!r}", "temperature")
        if 0 < self.temperature < MIN_SAMPLING_TEMPERATURE:
            raise RequestError(f"temperature must be 0 (greedy) or >= {MIN_SAMPLING_TEMPERATURE}, "
                               f"got {self.temperature!r}", "temperature")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not _is_int(self.top_k) or self.top_k < -1 or self.top_k >= 2**31:
            raise RequestError(f"top_k must be -1 or 0 (off) or a positive integer below 2**31, got {self.top_k!r}",
                               "top_k")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        if self.seed is not None and not _is_int(self.seed):
            raise RequestError(f"seed must be an integer, got {self.seed!r}", "seed")
        if not _is_int(self.n) or self.n < 1:
            raise RequestError(f"n must be an integer >= 1, got {self.n!r}", "n")

    def _check_lengths(self) -> None:
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise RequestError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise RequestError(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})",
                               "min_tokens")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise RequestError(f"{name} must be in [-2, 2], got {value!r}", name)
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise RequestError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty!r}",
                               "repetition_penalty")

    def _check_logprobs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < -1):
                raise RequestError(f"{name} must be an integer >= 0 (the top log probabilities per token, at most "
                                   f"the engine's --max-logprobs) or -1 (the whole vocabulary), got {value!r}", name)

    def _check_token_edits(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise RequestError("logit_bias must be a map from token id to a bias in [-100, 100]", "logit_bias")
            bias = {}
            for token, value in self.logit_bias.items():
                # JSON object keys are strings: ASCII digits only (isdigit also takes "²" and a fullwidth "５"),
                # and few of them (int() refuses 5,000 digits)
                if isinstance(token, str) and token.strip().isascii() and token.strip().isdigit() \
                        and len(token.strip()) <= 10:
                    token = int(token)
                if not _is_int(token) or token < 0:
                    raise RequestError(f"logit_bias keys must be token ids (non-negative integers), got "
                                       f"{str(token)[:20]!r}", "logit_bias")
                if not _is_number(value):
                    raise RequestError(f"logit_bias values must be finite numbers, got {value!r}", "logit_bias")
                bias[token] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(value)))   # clamped as vLLM/OpenAI
            object.__setattr__(self, "logit_bias", bias)
        if self.allowed_token_ids is not None:
            allowed = _token_id_list("allowed_token_ids", self.allowed_token_ids)
            if not allowed:
                raise RequestError("allowed_token_ids must not be empty (leave it unset to allow every token)",
                                   "allowed_token_ids")
            object.__setattr__(self, "allowed_token_ids", allowed)
        bad = self.bad_words
        if isinstance(bad, str) or not isinstance(bad, (list, tuple, type(None))) or any(
                not isinstance(w, str) or not w.strip() for w in bad or ()):
            raise RequestError("bad_words must be a list of non-blank strings", "bad_words")
        object.__setattr__(self, "bad_words", tuple(bad or ()))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def clone(self, **changes) -> SamplingParams:
        """A copy (vLLM's clone), with `changes` applied and checked as at construction. SamplingParams
        is immutable (it is validated once): change a field through clone(field=value) or
        dataclasses.replace(params, field=value)."""
        return replace(self, **changes)

    def for_sample(self, index: int) -> SamplingParams:
        """Sample index of n: one sample of its own (n=1); a seeded request's sample i gets seed + i (vLLM)."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)


def _refuse_assignment(self, name, value):
    raise dataclasses.FrozenInstanceError(
        f"SamplingParams is immutable (it is validated once); to change {name}, use "
        f"params.clone({name}=...) or dataclasses.replace(params, {name}=...)")


SamplingParams.__setattr__ = _refuse_assignment        # frozen, with a message that says what to do instead
