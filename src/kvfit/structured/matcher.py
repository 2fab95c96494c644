"""StructuredOutputs: compile a request's constraint once (cached), match its tokens, fill its bitmask rows.

Built once per engine from the tokenizer and the model's vocab_size (the logits width; ids past the
tokenizer's vocabulary are never allowed). compile_async builds on the engine's grammar threads (never
the engine thread: llguidance releases the GIL while it builds, which takes seconds for a large spec),
so other requests keep stepping while a request waits for its grammar. A definition too large to be
safe is validated in a child process first (structured/validate.py). The cache of compiled grammars
is bounded by their estimated bytes. A Matcher belongs to one request and is driven by one thread.

End of output: while the grammar may end here the mask allows EOS (every id of eos_token_ids and
the request's stop_token_ids) beside the tokens that continue it; once nothing can follow (a
choice completed, a closed JSON object) it allows only those. Accepting one terminates the matcher;
after that, or after a rejected token, the mask allows only EOS.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future

import llguidance
import torch

from kvfit.errors import RequestError
from kvfit.structured.bitmask import allocate_bitmask, apply_bitmask, bitmask_words
from kvfit.structured.grammar import grammar_definition, one_line
from kvfit.structured.tokenizer_info import build_ll_tokenizer
from kvfit.structured.validate import PARSER_LIMITS, SMALL_DEFINITION_CHARS, check_definition
from kvfit.structured_params import PARAM, StructuredOutputsParams

logger = logging.getLogger("kvfit")
DEFAULT_CACHE_BYTES = 256 * 2**20
# what a compiled grammar holds, estimated from its definition's length: measured 40-165 bytes of memory
# per definition character (Lark chains, choices, 2,000-property schemas), so an upper bound
COMPILED_BYTES_PER_DEFINITION_CHAR = 200
COMPILED_BASE_BYTES = 64 * 1024
COMPILE_STACK_BYTES = 64 * 2**20        # llguidance recurses over the grammar: never less stack than a main thread


def compile_threads() -> int:
    """Grammar threads: a quarter of the CPUs this process may use, 1 to 4 (each compile keeps a core busy;
    the engine's own thread needs one)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(4, cpus // 4))


class _CompileThreads:
    """A few daemon threads with deep stacks (a ThreadPoolExecutor cannot set its threads' stack size)."""

    def __init__(self, num_threads: int, stack_bytes: int):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        previous = threading.stack_size(stack_bytes)
        try:
            for i in range(num_threads):
                threading.Thread(target=self._work, name=f"kvfit-grammar-{i}", daemon=True).start()
        finally:
            threading.stack_size(previous)

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            future, fn, args = self._queue.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:        # handed to whoever waits on the future
                future.set_exception(exc)


class CompiledGrammar:
    """A compiled constraint: llguidance's matcher in its start state, copied (microseconds) per request."""

    def __init__(self, spec: StructuredOutputsParams, start: "llguidance.LLMatcher", num_bytes: int = 0):
        self.spec = spec
        self.num_bytes = num_bytes      # estimated memory (the cache's bound counts it)
        self._start = start
        self._lock = threading.Lock()   # the start state is shared by the threads that copy it

    def _copy(self) -> "llguidance.LLMatcher":
        with self._lock:
            return self._start.deep_copy()


def _set_bit(row: torch.Tensor, token_id: int) -> None:
    word, bit = divmod(token_id, 32)
    value = int(row[word]) | (1 << bit)
    row[word] = value - (1 << 32) if value >= 1 << 31 else value     # as a signed int32


class Matcher:
    """One request's position in its grammar: accept the sampled token, fill the next step's mask row."""

    def __init__(self, state: "llguidance.LLMatcher", vocab_size: int, eos_token_ids: tuple[int, ...],
                 stop_token_ids: tuple[int, ...]):
        self._state = state
        self._vocab_size = vocab_size
        self._eos = eos_token_ids[0]
        self._eos_ids = eos_token_ids
        # the request's own stop ids end the output where the grammar allows EOS
        self._extra_stops = tuple(t for t in stop_token_ids if t not in eos_token_ids and 0 <= t < vocab_size)
        self._terminated = False

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False when the grammar does not allow it (the matcher then stays
        in error and its mask allows only EOS). An EOS or stop id the grammar allows terminates it."""
        token_id = int(token_id)
        if self._terminated or not 0 <= token_id < self._vocab_size or self._state.is_error():
            return False
        is_stop = token_id in self._eos_ids or token_id in self._extra_stops
        # validate_tokens reports 0 on a stopped matcher (nothing may follow but EOS), so ask both
        if is_stop and (self._state.is_stopped() or self._state.validate_tokens([self._eos]) == 1):
            self._terminated = self._state.consume_token(self._eos)
            return self._terminated
        # a token the mask let through into a dead end (a schema feature llguidance's mask does not follow to the
        # end) leaves the matcher in error: the output can no longer be completed, so it ends in error, never stop
        return self._state.consume_token(token_id) and not self._state.is_error()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into bitmask[row] (a CPU int32 bitmask from allocate_bitmask)."""
        assert bitmask.dtype == torch.int32 and bitmask.device.type == "cpu", "bitmask must be CPU int32"
        target = bitmask[row]
        assert target.is_contiguous() and target.numel() == bitmask_words(self._vocab_size), "bitmask width"
        self._state.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)
        self._add_stops(target)

    def _add_stops(self, target: torch.Tensor) -> None:
        if self._extra_stops and (int(target[self._eos // 32]) >> (self._eos % 32)) & 1:
            for token_id in self._extra_stops:
                _set_bit(target, token_id)

    def is_terminated(self) -> bool:
        """True once an EOS or stop token the grammar allowed was accepted."""
        return self._terminated

    @property
    def error(self) -> str | None:
        """Why the last token was rejected (one line), or None."""
        return one_line(self._state.get_error()) if self._state.is_error() else None


class StructuredOutputs:
    """Per engine: compile_async(spec) / compile(spec) (cached, bounded by bytes, thread-safe),
    matcher(spec), bitmasks sized for the model.

    tokenizer: kvfit's Tokenizer (its tokenizers backend and eos_token_id); vocab_size: the model's
    logits width; eos_token_ids: the ids that end output when the grammar is complete (default: the
    tokenizer's eos_token_id; pass generation_config.json's list when it has several). cache_bytes: the
    most estimated bytes of compiled grammars kept. parser_limits: llguidance's LLParserLimits fields.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int] | None = None,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, parser_limits: dict | None = None):
        if eos_token_ids is None:
            eos_token_ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._backend = tokenizer.backend
        self._ll_tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._cache_lock = threading.Lock()
        self.cache_bytes = cache_bytes
        self.num_cached_bytes = 0       # estimated bytes of the compiled grammars in the cache
        self._limits = llguidance.LLParserLimits(**{**PARSER_LIMITS, **(parser_limits or {})})
        self._executor = None
        self._threads: _CompileThreads | None = None

    def _tokenizer(self) -> "llguidance.LLTokenizer":
        # built on first use (about a second for a 150k vocabulary), once, whichever thread gets here first
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = build_ll_tokenizer(self._backend, self.vocab_size, self.eos_token_ids)
            return self._ll_tokenizer

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of spec, waited for (see compile_async)."""
        return self.compile_async(spec).result()

    def compile_async(self, spec: StructuredOutputsParams) -> Future:
        """A future of spec's CompiledGrammar, built on the grammar threads (the cache's when an equal spec was
        compiled or is compiling); its exception is a RequestError (param structured_outputs) with the
        library's message when it refuses the schema/regex/grammar. A refused spec is not cached."""
        key = spec.key
        with self._cache_lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            if self._threads is None:
                self._threads = _CompileThreads(compile_threads(), COMPILE_STACK_BYTES)
            future = self._cache[key] = self._threads.submit(self._build, spec)
        future.add_done_callback(lambda done: self._cached(key, done))
        return future

    def _cached(self, key: tuple, future: Future) -> None:
        """A build finished: a refused spec leaves the cache, a compiled one counts its bytes (least recently
        used ones evicted past cache_bytes; one larger than the whole budget is not kept)."""
        with self._cache_lock:
            if self._cache.get(key) is not future:
                return
            if future.exception() is not None:
                del self._cache[key]
                return
            self.num_cached_bytes += future.result().num_bytes
            for old_key in list(self._cache):
                if self.num_cached_bytes <= self.cache_bytes:
                    break
                old = self._cache[old_key]
                if old.done():                  # one still compiling has no bytes yet
                    del self._cache[old_key]
                    self.num_cached_bytes -= old.result().num_bytes

    def _build(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        definition = grammar_definition(spec)
        if len(definition) > SMALL_DEFINITION_CHARS:
            check_definition(spec.kind, definition)     # in a child process: a crash there is this request's
        start = llguidance.LLMatcher(self._tokenizer(), definition, log_level=0, limits=self._limits)
        if start.is_error():
            raise RequestError(f"structured_outputs.{spec.kind}: {one_line(start.get_error())}", PARAM)
        for warning in start.get_grammar_warnings():
            logger.warning("structured_outputs.%s: %s", spec.kind, one_line(warning))
        num_bytes = COMPILED_BASE_BYTES + COMPILED_BYTES_PER_DEFINITION_CHAR * len(definition)
        return CompiledGrammar(spec, start, num_bytes)

    def matcher(self, spec: StructuredOutputsParams | CompiledGrammar, stop_token_ids: Sequence[int] = ()) -> Matcher:
        """A fresh Matcher for one request (compiling spec if needed); stop_token_ids: the request's own."""
        compiled = spec if isinstance(spec, CompiledGrammar) else self.compile(spec)
        return Matcher(compiled._copy(), self.vocab_size, self.eos_token_ids, tuple(stop_token_ids))

    def allocate_bitmask(self, rows: int, pin_memory: bool = False) -> torch.Tensor:
        """A CPU int32 bitmask [rows, ceil(vocab_size / 32)], every token allowed."""
        return allocate_bitmask(rows, self.vocab_size, pin_memory)

    def fill_bitmask(self, bitmask: torch.Tensor, matchers: Sequence[tuple[Matcher, int]]) -> None:
        """Fill bitmask[row] for every (matcher, row), in parallel on llguidance's threads."""
        if not matchers:
            return
        assert bitmask.dtype == torch.int32 and bitmask.device.type == "cpu" and bitmask.is_contiguous()
        assert bitmask.shape[1] == bitmask_words(self.vocab_size), "bitmask width"
        assert all(0 <= row < bitmask.shape[0] for _, row in matchers), "row out of range"
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        self._executor.unsafe_compute_mask_ptr([(m._state, row) for m, row in matchers], bitmask.data_ptr(),
                                               bitmask.shape[1] * 4, bitmask.shape[0])
        for m, row in matchers:
            m._add_stops(bitmask[row])

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor,
                      rows: Sequence[int] | torch.Tensor | None = None) -> None:
        """logits[i, t] = -inf where bit t of bitmask[i] is 0 or t >= vocab_size, in place, for i in rows
        (default: every row of logits); CPU or CUDA logits, the bitmask copied to their device."""
        apply_bitmask(logits, bitmask, rows, self.vocab_size)
