"""The one admission check: can this request ever be served? Pure; raises RequestError(param, code).

The server maps the error to OpenAI's 400 body from its param and code, without checking again.
"""

from __future__ import annotations

from kvfit.errors import RequestError
from kvfit.kv.spec import num_blocks_for_tokens
from kvfit.sampling_params import MAX_LOGPROBS, SamplingParams

# bad words are tokenized off the engine thread and matched against the output every step: a bounded list
MAX_BAD_WORDS = 1024


def check_cache_salt(cache_salt) -> str | None:
    """vLLM's cache_salt: None, or a non-empty string (requests share prefix-cache blocks only with
    the same salt); anything else is a RequestError naming it."""
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        got = "an empty string" if isinstance(cache_salt, str) else f"a {type(cache_salt).__name__}"
        raise RequestError(f"cache_salt must be a non-empty string (requests share prefix-cache blocks only with "
                           f"the same salt), got {got}; give a string or leave it out", "cache_salt")
    return cache_salt


def are_token_ids(ids) -> bool:
    """Every element is an int and none a bool. Plain ints take one C-level pass over the types (a prompt
    of thousands of tokens costs microseconds, not a Python loop per token); int subclasses take the slow one."""
    if set(map(type, ids)) <= {int}:
        return True
    return all(isinstance(t, int) and not isinstance(t, bool) for t in ids)


def check_request(prompt_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                  block_size: int, num_blocks: int, strict_context: bool = False,
                  max_logprobs: int = MAX_LOGPROBS) -> int:
    """Return the request's max_total_tokens (prompt + output, at most max_model_len).

    strict_context: prompt + max_tokens past max_model_len is an error (the server, when the client
    set max_tokens); otherwise generation stops at max_model_len with finish reason "length".
    max_logprobs: the engine's --max-logprobs, resolved (-1 is the vocabulary size).
    """
    if not isinstance(params, SamplingParams):
        raise RequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}",
                           "sampling_params")
    for name in ("logprobs", "prompt_logprobs"):        # -1: the whole vocabulary (vLLM's)
        value = getattr(params, name)
        if value == -1 and vocab_size > max_logprobs:
            raise RequestError(f"{name} is -1 (the whole vocabulary, {vocab_size} tokens), more than this engine's "
                               f"--max-logprobs of {max_logprobs} allows; start the engine with --max-logprobs -1",
                               name)
        check_logprobs_count(None if value == -1 else value, max_logprobs, name)
    # each of n samples holds at least one token of its own in the KV cache: a larger n can never be
    # served (and 2**63 children would be built one by one before anything ran)
    if params.n > num_blocks * block_size:
        raise RequestError(f"n={params.n} samples is more than the KV cache's token capacity "
                           f"({num_blocks * block_size} tokens, one at least per sample); ask for fewer", "n")
    if not are_token_ids(prompt_ids):
        raise RequestError("a token-id prompt must be a list of integers", "prompt")
    _check_token_ids(params, vocab_size)
    if len(params.bad_words) > MAX_BAD_WORDS:
        raise RequestError(f"bad_words has {len(params.bad_words)} entries, more than kvfit's limit of {MAX_BAD_WORDS}; "
                           "give fewer", "bad_words")
    num_prompt = len(prompt_ids)
    if num_prompt == 0:
        raise RequestError("the prompt is empty; give at least one token", "prompt")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        at, bad = next((i, t) for i, t in enumerate(prompt_ids) if not 0 <= t < vocab_size)
        raise RequestError(f"prompt token ids must be in [0, {vocab_size}); got {bad} at position {at}", "prompt")
    if num_prompt >= max_model_len:
        raise RequestError(
            f"the prompt has {num_prompt} tokens but --max-model-len is {max_model_len} (prompt + at least one "
            "output token); shorten the prompt or raise --max-model-len", "prompt", "context_length_exceeded")
    max_tokens = params.max_tokens
    if strict_context and max_tokens is not None and num_prompt + max_tokens > max_model_len:
        raise RequestError(
            f"the prompt has {num_prompt} tokens and max_tokens is {max_tokens}: {num_prompt + max_tokens} > "
            f"the context (--max-model-len) of {max_model_len}; lower max_tokens to at most "
            f"{max_model_len - num_prompt}", "max_tokens", "context_length_exceeded")
    max_total_tokens = min(num_prompt + (max_tokens or max_model_len), max_model_len)
    blocks = num_blocks_for_tokens(max_total_tokens, block_size)
    if blocks > num_blocks:
        raise RequestError(f"the request needs {blocks} KV blocks but the cache has {num_blocks}; "
                           "lower max_tokens or give the cache more memory", "max_tokens")
    return max_total_tokens


def check_logprobs_count(value: int | None, max_logprobs: int, param: str) -> None:
    """A top-logprobs count within the engine's --max-logprobs (vLLM's check; the server names its own field)."""
    if value is not None and value > max_logprobs:
        raise RequestError(f"{param} is {value}, more than this engine's --max-logprobs of {max_logprobs} allows "
                           f"(the top log probabilities per token); ask for at most {max_logprobs}, or start the "
                           "engine with a larger --max-logprobs", param)


def _check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Token ids in the params must be in the model's vocabulary (vLLM checks these at admission too)."""
    for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ()),
                      ("stop_token_ids", params.stop_token_ids)):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise RequestError(f"{name} holds token id {bad[0]}, outside the vocabulary [0, {vocab_size})", name)


def bad_words_token_ids(bad_words: tuple[str, ...], encode, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token ids as vLLM derives them: the word (left-stripped) alone, and with a leading
    space when that gives a different first token and as many tokens (a word mid-text). encode: text ->
    ids without special tokens."""
    out: list[tuple[int, ...]] = []
    for word in bad_words:
        alone = tuple(encode(word.lstrip()))
        if alone:
            out.append(alone)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and (not alone or (spaced[0] != alone[0] and len(spaced) == len(alone))):
            out.append(spaced)
    if any(t >= vocab_size for ids in out for t in ids):
        raise RequestError("bad_words tokenize to ids outside the model's vocabulary", "bad_words")
    return tuple(out)
