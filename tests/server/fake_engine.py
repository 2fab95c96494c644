"""A stand-in for LLMEngine with the surface the server uses; characters are tokens, no model."""

from __future__ import annotations

import time
import types

from kvfit.engine.output import CompletionOutput, Logprob, RequestOutput
from kvfit.engine.admission import check_request
from kvfit.errors import ConfigError
from kvfit.sampling_params import MAX_LOGPROBS


class CharTokenizer:
    """One token per character (its code point); no special tokens; a chat template only when given one."""

    chat_template = None
    vocab_size = 0x110000
    cleans_up_spaces = False

    @property
    def backend(self):
        """What the incremental detokenizer decodes windows with (as kvfit's Tokenizer's tokenizers.Tokenizer)."""
        return self

    def id_to_token(self, token_id: int) -> str:
        return chr(token_id)

    def get_vocab(self, with_added_tokens: bool = True) -> dict:
        return {}           # too many to list; every token is one character

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def token_text(self, token_id: int) -> str:
        return chr(token_id)

    def convert_ids_to_tokens(self, ids) -> list[str]:
        return [chr(i) for i in ids]

    def apply_chat_template(self, messages, add_generation_prompt=True, *, continue_final_message=False,
                            chat_template=None, template_kwargs=None, tokenize=False, tools=None):
        if chat_template is None:
            raise ConfigError("this model has no chat_template in tokenizer_config.json")
        from kvfit.text.chat_template import compile_chat_template, render_chat_template
        text = render_chat_template(compile_chat_template(chat_template), messages, add_generation_prompt, {},
                                    continue_final_message, template_kwargs, tools)
        return self.encode(text) if tokenize else text


class FakeEngine:
    """Each step appends 'a', 'b', ... to each running request (at most max_running run, the rest wait);
    with n > 1, sample i is shifted by i letters; logprobs are made up (see _sample).

    A prompt containing `fail_step_on` makes step() raise; one containing `fail_add_on` makes
    add_request() raise an unexpected error.
    """

    def __init__(self, max_model_len: int = 64, max_running: int = 64, step_seconds: float = 0.0,
                 fail_step_on: str = "FAIL-STEP", fail_add_on: str = "FAIL-ADD"):
        self.max_model_len = max_model_len
        self.tokenizer = CharTokenizer()
        self.plan = types.SimpleNamespace(token_capacity=1024, log_line=lambda: "fake plan")
        # as --generation-config vllm: no defaults from a generation_config.json
        self.config = types.SimpleNamespace(model=types.SimpleNamespace(generation_config="vllm"))
        self.default_sampling_params = {}
        self.max_logprobs = MAX_LOGPROBS            # --max-logprobs left at vLLM's default
        self.eos_token_ids = ()
        self.max_running, self.step_seconds = max_running, step_seconds
        self.fail_step_on, self.fail_add_on = fail_step_on, fail_add_on
        self.requests: dict[str, dict] = {}      # insertion order = arrival order
        self.num_aborted = 0

    def encode(self, text):
        return self.tokenizer.encode(text)

    def add_request(self, prompt, params, request_id, strict_context=False, cache_salt=None):
        prompt = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        # the engine's own admission check, over a cache with room for anything
        check_request(prompt, params, 0x110000, self.max_model_len, 16, 10**6, strict_context, self.max_logprobs)
        if self.fail_add_on in self.tokenizer.decode(prompt):
            raise RuntimeError("add exploded")
        self.requests[request_id] = {"prompt": prompt, "out": [], "params": params, "cache_salt": cache_salt}
        return request_id

    def abort(self, request_id):
        found = self.requests.pop(request_id, None) is not None
        self.num_aborted += found
        return found

    def has_unfinished(self):
        return bool(self.requests)

    def check_alive(self):
        """One process: a failed step never stops the next (FakeTPEngine's can)."""

    def _running(self):
        return list(self.requests.items())[:self.max_running]

    def step(self):
        time.sleep(self.step_seconds)
        outputs = []
        for request_id, r in self._running():
            if self.fail_step_on in self.tokenizer.decode(r["prompt"]):
                raise RuntimeError("step exploded")
            r["out"].append(ord("a") + len(r["out"]) % 26)
            max_tokens = r["params"].max_tokens or self.max_model_len - len(r["prompt"])
            finished = len(r["out"]) >= max_tokens
            if finished:
                del self.requests[request_id]
            samples = [self._sample(i, r["out"], r["params"], finished) for i in range(getattr(r["params"], "n", 1))]
            outputs.append(RequestOutput(request_id, None, r["prompt"], outputs=samples, finished=finished))
        return outputs

    def _sample(self, index: int, out: list[int], params, finished: bool) -> CompletionOutput:
        """Sample i is the letters shifted by i ('ab', 'bc', ...); with logprobs, each token has logprob
        -(i + 1) / 10 and rank 1, and the next k - 1 letters follow it (the top k), each 1 lower."""
        ids = [ord("a") + (t - ord("a") + index) % 26 for t in out]
        k = getattr(params, "logprobs", None)
        logprobs = None if k is None else [
            {t + j: Logprob(-(index + 1) / 10 - j, j + 1, chr(t + j)) for j in range(max(k, 1))} for t in ids]
        return CompletionOutput(index, self.tokenizer.decode(ids), ids, None, logprobs,
                                "length" if finished else None)

    def stats(self):
        running = len(self._running())
        return {"kv_blocks_total": 64, "kv_blocks_free": 64 - running, "kv_blocks_used": running,
                "kv_blocks_cached": 0, "token_capacity": 1024, "block_size": 16, "running": running,
                "waiting": len(self.requests) - running, "preemptions": 0, "prefix_cache_queries": 0,
                "prefix_cache_hits": 0}

    def shutdown(self):
        pass
