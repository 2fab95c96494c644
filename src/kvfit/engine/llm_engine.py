"""LLMEngine: admission, the step loop (schedule -> execute -> apply tokens -> outputs), stats.

Start-up happens before, in engine/startup.py; the engine wires what it produced to a scheduler,
a KV cache manager and an output processor.
"""

from __future__ import annotations

import functools
import itertools
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import replace
import logging
import os

from kvfit.config import EngineConfig
from kvfit.engine.admission import bad_words_token_ids, check_cache_salt, check_request
from kvfit.planning import resolve_max_logprobs
from kvfit.engine.headroom import HeadroomWatch
from kvfit.engine.output import RequestOutput
from kvfit.engine.output_processor import OutputProcessor
from kvfit.engine.parallel_sampling import ParentRequest, child_request_id
from kvfit.engine.request import Request, RequestStatus
from kvfit.engine.scheduler import Scheduler
from kvfit.engine.startup import start_engine
from kvfit.errors import ConfigError, KvfitError, RequestError
from kvfit.kv.manager import KVCacheManager
from kvfit.model_facts import load_model_facts
from kvfit.kv.pool import BlockPool
from kvfit.sampling_params import SamplingParams
from kvfit.step import SampledTokens, StepDelta

logger = logging.getLogger("kvfit")
PREPARE_POLL_S = 0.01       # with only requests being prepared, a step waits this long for one to be ready


class LLMEngine:
    """Owns the scheduler, the KV cache manager, the output processor and the executor."""

    def __init__(self, config: EngineConfig):
        # vLLM's get_diff_sampling_param: what a request (or LLM.generate without params) does not set;
        # read before the engine starts, so a bad file fails fast
        self.default_sampling_params = _generation_defaults(config)
        # the folder's tokenizer and eos ids too: a broken file is one error line before any weight loads
        tokenizer = _load_tokenizer(config.model.model)
        facts = load_model_facts(config.model.model, config.model.quantization)
        eos_token_ids = _eos_ids(config.model.model, facts, tokenizer)
        started = start_engine(config, facts)          # the facts read once
        self.config = config = started.config        # with the platform's defaults filled in
        self.facts, self.platform, self.spec, self.limits = started.facts, started.platform, started.spec, started.limits
        self.workers = started.executor
        self.readings, self.plan = started.readings, started.plan
        self.num_scheduler_steps = started.num_scheduler_steps
        self.async_scheduling = started.async_scheduling
        self._inflight = None       # (delta, its token reader): launched, not yet applied (async scheduling)
        self._shut_down = False
        self.pool = BlockPool(self.plan.num_blocks, config.cache.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, self.spec.block_size)
        self.scheduler = Scheduler(self.kv, self.limits.max_model_len, config.scheduler.max_num_seqs,
                                   config.scheduler.max_num_batched_tokens)
        # memory outside the plan growing while serving slows admission before an out-of-memory
        self.headroom = HeadroomWatch(self.platform.free_device_bytes, self.platform.total_device_bytes())
        self.tokenizer = tokenizer
        self.outputs = OutputProcessor(self.tokenizer)
        self.eos_token_ids = eos_token_ids
        self._ids = itertools.count()
        self._parents: dict[str, ParentRequest] = {}     # n > 1 requests by id
        self._structured_outputs = None
        self._preparer: ThreadPoolExecutor | None = None    # bad words are tokenized there (built when needed)

    @property
    def device_name(self) -> str:
        return self.platform.name

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    @property
    def max_logprobs(self) -> int:
        """The most top logprobs a request may ask for per token (--max-logprobs, resolved)."""
        return resolve_max_logprobs(self.facts, self.config.model.max_logprobs)

    # requests -----------------------------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    strict_context: bool = False, cache_salt: str | None = None) -> str:
        """Queue a prompt (text or token ids); raise RequestError if it can never be served.

        strict_context: prompt + max_tokens past --max-model-len is an error rather than a cut.
        cache_salt: vLLM's prefix-cache isolation; the request shares cached blocks only with
        requests of the same salt (None: with every unsalted request).
        params.n > 1 queues n child requests (engine/parallel_sampling.py) under this request id."""
        self._check_open()
        if isinstance(params, SamplingParams) and self.tokenizer is None:
            for name, needs in (("stop", params.stop), ("bad_words", params.bad_words),
                                ("structured_outputs", params.structured_outputs)):
                if needs:
                    raise RequestError(f"{name} needs a tokenizer (tokenizer.json), which this model folder lacks",
                                       name)
        if not isinstance(prompt, (str, list, tuple)):
            raise RequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}",
                               "prompt")
        check_cache_salt(cache_salt)
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        max_total = check_request(ids, params, self.facts.vocab_size, self.max_model_len, self.spec.block_size,
                                  self.pool.num_blocks, strict_context, self.max_logprobs)
        if -1 in (params.logprobs, params.prompt_logprobs):     # the whole vocabulary, as vLLM reads -1
            vocab = self.facts.vocab_size
            params = params.clone(**{name: vocab for name in ("logprobs", "prompt_logprobs")
                                     if getattr(params, name) == -1})
        request_id = request_id if request_id is not None else str(next(self._ids))     # vLLM LLM's ids: "0", "1", ...
        child_ids = [request_id] if params.n == 1 else [child_request_id(request_id, i) for i in range(params.n)]
        for rid in dict.fromkeys([request_id, *child_ids]):
            if rid in self.scheduler.requests or rid in self._parents:
                raise RequestError(f"request id {rid!r} is already in use", "request_id")
        pending = self._prepare(params)
        text = prompt if isinstance(prompt, str) else None
        if params.n > 1:
            self._parents[request_id] = ParentRequest(request_id, params.n, text, ids)
        for index, rid in enumerate(child_ids):
            child = params if params.n == 1 else params.for_sample(index)
            if index > 0 and child.prompt_logprobs is not None:
                child = replace(child, prompt_logprobs=None)     # the same as sample 0's
            req = Request(request_id=rid, prompt_token_ids=ids, params=child, eos_token_ids=self.eos_token_ids,
                          max_total_tokens=max_total, index=index,
                          parent_id=request_id if params.n > 1 else None, cache_salt=cache_salt, pending=pending)
            self.scheduler.add(req)
            self.outputs.add(req, text)
        return request_id

    def _prepare(self, params: SamplingParams) -> tuple:
        """What a request waits for before it is scheduled, prepared off the engine thread (vLLM compiles
        grammars so, its WAITING_FOR_FSM): (its grammar's future or None, its bad words' token ids' future
        or None); () when it needs neither."""
        if not params.structured_outputs and not params.bad_words:
            return ()
        grammar = self._structured().compile_async(params.structured_outputs) if params.structured_outputs else None
        bad_words = None
        if params.bad_words:
            if self._preparer is None:
                self._preparer = ThreadPoolExecutor(1, thread_name_prefix="kvfit-request-prep")
            encode = functools.partial(self.tokenizer.encode, add_special_tokens=False)
            bad_words = self._preparer.submit(bad_words_token_ids, params.bad_words, encode, self.facts.vocab_size)
        return grammar, bad_words

    def _release_prepared(self, outputs: dict[str, RequestOutput]) -> None:
        """Preparing requests whose grammar and bad words are ready join the waiting queue (arrival order);
        one whose grammar was refused ends with finish reason 'error' and the reason as its stop_reason."""
        for req in [r for r in self.scheduler.preparing if all(f is None or f.done() for f in r.pending)]:
            grammar, bad_words = req.pending
            failed = next((f.exception() for f in req.pending if f is not None and f.exception() is not None), None)
            if failed is not None:
                reason = str(failed) if isinstance(failed, KvfitError) else f"preparing the request failed: {failed!r}"
                logger.warning("request %s: %s; ending it (finish reason 'error')", req.request_id, reason)
                self.scheduler.finish(req.request_id, "error")
                outputs[req.request_id] = self.outputs.fail(req, reason)
                continue
            req.pending = ()
            if grammar is not None:
                req.matcher = self._structured().matcher(grammar.result(), req.params.stop_token_ids)
            if bad_words is not None:
                req.bad_words_token_ids = bad_words.result()
            self.scheduler.release(req)

    def _wait_for_preparation(self) -> None:
        """Nothing to run but requests being prepared: wait a little for one (not a busy loop)."""
        futures = [f for req in self.scheduler.preparing for f in req.pending if f is not None]
        if futures:
            wait(futures, timeout=PREPARE_POLL_S, return_when=FIRST_COMPLETED)

    def _structured(self):
        """The engine's grammar compiler (built at the first structured request)."""
        if self._structured_outputs is None:
            from kvfit.structured import StructuredOutputs
            self._structured_outputs = StructuredOutputs(self.tokenizer, self.facts.vocab_size, self.eos_token_ids)
        return self._structured_outputs

    def abort(self, request_id: str) -> bool:
        """Abort a request (every sample of an n > 1 request); its blocks are freed at once. False if it
        was not active."""
        if not isinstance(request_id, str):
            raise RequestError(f"a request id is a string, got {type(request_id).__name__}", "request_id")
        child = self._child_parent(request_id)
        if child is not None:               # one sample of n: the request is aborted as a whole (vLLM)
            request_id = child[0].request_id
        parent = self._parents.pop(request_id, None)
        ids = parent.child_ids if parent is not None else [request_id]
        aborted = False
        for rid in ids:
            self.outputs.drop(rid)
            aborted = self.scheduler.finish(rid, "abort") is not None or aborted
        return aborted

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def check_alive(self) -> None:
        """Raise EngineDeadError when the executor cannot run another step (a tensor-parallel rank exited, or
        a failed step stopped the ranks); a step that failed otherwise leaves the engine serving."""
        self.workers.check_alive()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's reset_prefix_cache: after a weight update, or between
        benchmark runs). False, with a warning, while requests hold blocks (a waiting request that holds
        none does not stop it: it matches against the emptied cache when admitted)."""
        if self.pool.num_used_blocks:
            logger.warning("cannot reset the prefix cache: %d blocks are held by unfinished requests",
                           self.pool.num_used_blocks)
            return False
        self.pool.reset_prefix_cache()
        logger.info("prefix cache reset")
        return True

    # the loop -----------------------------------------------------------------------------------
    def step(self, stream: bool = True) -> list[RequestOutput]:
        """Schedule, execute, apply; return an output for every request that got tokens
        (stream=False: for the requests that finished only, so no text is built for callers early).

        A multi-step delta (--num-scheduler-steps) returns several tokens per request; they are
        applied one at a time, in order, so stops and stop strings end a request at the same
        token as single steps would (tokens sampled past the end are dropped).
        """
        self._check_open()
        outputs: dict[str, RequestOutput] = {}
        self._release_prepared(outputs)
        try:
            ran = self._launch_and_read()
        except BaseException:
            # the step did not run to its tokens: the blocks scheduled for it hold no K/V
            self.scheduler.forget_unrun_commits()
            raise
        if ran is None:
            if not outputs:
                self._wait_for_preparation()
            return self._fold_samples(outputs, stream)
        delta, tokens = ran
        for request_id, (first, entries) in tokens.prompt_logprobs.items():
            req = self.scheduler.requests.get(request_id)
            # a round read late (async scheduling) may name an id that ended and was re-added since
            if req is not None and req.status is RequestStatus.RUNNING:
                self.outputs.add_prompt_logprobs(req, first, entries)
        for k in range(delta.max_num_steps):
            self._apply(delta, tokens, k, stream, outputs)
        self.scheduler.admission_paused = self.headroom.after_step()
        return self._fold_samples(outputs, stream)

    def _launch_and_read(self) -> tuple[StepDelta, SampledTokens] | None:
        """The step to apply and its tokens (None: nothing to run). Async scheduling: the step is the one the
        previous call launched, and the next one is launched before this one's tokens are read."""
        inflight, self._inflight = self._inflight, None     # async scheduling: launched by the previous step
        if inflight is not None and not self._still_running(inflight[0]):
            inflight[1]()               # every request of the round in flight has ended: read it, drop it
            inflight = None
        if inflight is not None:
            delta, pending = inflight
        else:
            delta = self.scheduler.schedule(self.num_scheduler_steps)
            if delta.empty:
                # with requests waiting, only possible when the head request cannot get blocks with
                # nothing running, which admission rules out: fail loudly rather than spin
                assert not self.scheduler.waiting, "scheduler made no progress with requests waiting"
                if delta.removed_ids:       # ended requests: the runner still drops their rows
                    self.workers.execute(delta)
                return None
            pending = self._launch(self._with_bitmasks(delta))
        if self.async_scheduling:
            # the next step goes on the device before this one's tokens are read, so the device does
            # not wait while the host applies them
            after = self.scheduler.schedule_continuation(delta, self.num_scheduler_steps)
            if after is not None:
                self._inflight = (after, self._launch(after))
        return delta, pending()

    def _still_running(self, delta: StepDelta) -> bool:
        requests = self.scheduler.requests
        return any(rid in requests and requests[rid].status is RequestStatus.RUNNING for rid in delta.request_ids)

    def _launch(self, delta: StepDelta):
        """Put the delta on the device; return what reads its tokens."""
        if self.async_scheduling:
            return self.workers.launch(delta)
        tokens = self.workers.execute(delta)
        return lambda: tokens

    def _with_bitmasks(self, delta: StepDelta) -> StepDelta:
        """Structured outputs: each scheduled grammar request's allowed tokens, filled on the host now."""
        structured = [self.scheduler.requests[rid] for rid in delta.request_ids
                      if self.scheduler.requests[rid].matcher is not None]
        if not structured:
            return delta
        compiler = self._structured()
        bitmask = compiler.allocate_bitmask(len(structured))                               # [S, words] int32
        compiler.fill_bitmask(bitmask, [(req.matcher, i) for i, req in enumerate(structured)])
        return replace(delta, token_bitmasks={req.request_id: bitmask[i].numpy().tobytes()
                                              for i, req in enumerate(structured)})

    def _fold_samples(self, outputs: dict[str, RequestOutput], stream: bool) -> list[RequestOutput]:
        """Outputs of n > 1 children become their parent's (streaming: at each child's progress; else once,
        when every sample has finished)."""
        result, touched = [], {}
        for out in outputs.values():
            req_parent = self._child_parent(out.request_id)
            if req_parent is None:
                result.append(out)
                continue
            parent, index = req_parent
            parent.update(out, index)
            touched[parent.request_id] = parent
        for parent in touched.values():
            if parent.done:
                del self._parents[parent.request_id]
            if parent.done or stream:
                result.append(parent.output())
        return result

    def _child_parent(self, request_id: str):
        prefix, _, parent_id = request_id.partition("_")
        parent = self._parents.get(parent_id)
        if parent is None or not prefix.isdigit() or int(prefix) >= len(parent.child_ids):
            return None
        return parent, int(prefix)

    def _apply(self, delta: StepDelta, tokens: SampledTokens, step: int, stream: bool,
               outputs: dict[str, RequestOutput]) -> None:
        """Apply step `step` of the delta: record tokens, decide finishes, make outputs (a finished
        request's, and when streaming each request's after its last token of the delta)."""
        sampled = {rid: toks[step] for rid, toks in tokens.tokens.items() if step < len(toks)}
        for request_id in tokens.nonfinite_at(step):
            req = self.scheduler.requests.get(request_id)
            # this request fails alone; a round read late (async scheduling) may name an id that ended and
            # was re-added since: only the running request is its
            if req is not None and req.status is RequestStatus.RUNNING:
                logger.warning("request %s: the model's logits were not finite; ending it (finish reason "
                               "'error')", request_id)
                self.scheduler.forget_unrun_commits(request_id)    # no later prompt reuses its K/V
                self.scheduler.finish(request_id, "error")
                outputs[request_id] = self.outputs.output(req, finished=True)
        logprobs = tokens.logprobs
        for req in self.scheduler.update(delta, sampled, step):
            if req.request_id in logprobs:
                self.outputs.add_logprobs(req, logprobs[req.request_id][step])
            if req.matcher is not None and not req.matcher.accept(req.token_ids[-1]):
                # the grammar went past llguidance's run-time limits, or its mask let a token into a dead end (a
                # schema feature the mask does not follow to its end): the client sees why in stop_reason
                reason = (f"structured_outputs: the grammar cannot complete this output (at token "
                          f"{req.token_ids[-1]}: {req.matcher.error or 'the grammar does not allow it'})")
                logger.warning("request %s: %s; ending it (finish reason 'error')", req.request_id, reason)
                self.scheduler.finish(req.request_id, "error")
                outputs[req.request_id] = self.outputs.fail(req, reason)
                continue
            reason = self.outputs.finish_reason(req)
            if reason is not None:
                self.scheduler.finish(req.request_id, reason)
                outputs[req.request_id] = self.outputs.output(req, finished=True)
            elif stream and step + 1 == len(tokens.tokens[req.request_id]) \
                    and req.request_id not in tokens.nonfinite_ids:     # that one ends at the next step
                outputs[req.request_id] = self.outputs.output(req, finished=False)

    def stats(self) -> dict:
        pool, sched = self.pool, self.scheduler
        return {"kv_blocks_total": pool.num_blocks, "kv_blocks_free": pool.num_free_blocks,
                "kv_blocks_used": pool.num_used_blocks, "kv_blocks_cached": pool.num_cached_blocks,
                "token_capacity": self.plan.token_capacity, "block_size": self.spec.block_size,
                "running": len(sched.running),
                # a request being prepared (grammar, bad words) is waiting too
                "waiting": len(sched.waiting) + len(sched.preparing), "preparing": len(sched.preparing),
                "preemptions": sched.num_preemptions,
                "prefix_cache_queries": sched.num_prefix_queries, "prefix_cache_hits": sched.num_prefix_hits,
                # free device memory at the last check (None: the platform cannot say); admission_paused: too little
                "device_headroom_bytes": self.headroom.headroom_bytes, "admission_paused": self.headroom.paused,
                # times the allocator cache went back to the device to stay in the budget (each a device sync);
                # None where the platform keeps no cache, and under tensor parallelism (each rank counts its own)
                "allocator_cache_releases": getattr(getattr(self.workers, "platform", None), "num_cache_releases",
                                                    None)}

    def shutdown(self) -> None:
        """Stop the workers and give their device memory back; the engine serves nothing after it."""
        self._shut_down = True
        if self._preparer is not None:
            self._preparer.shutdown(wait=False, cancel_futures=True)
        self.workers.shutdown()

    def _check_open(self) -> None:
        if self._shut_down:
            raise KvfitError("this engine was shut down (its memory given back); create a new one to generate again")


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """A prompt text's token ids, special tokens added; RequestErrors for a non-string or no tokenizer."""
    if not isinstance(prompt, str):
        raise RequestError(f"a prompt to encode must be a string, got {type(prompt).__name__}", "prompt")
    if tokenizer is None:
        raise RequestError("this model has no tokenizer (tokenizer.json); pass prompt token ids instead of text",
                           "prompt")
    return tokenizer.encode(prompt)


def _load_tokenizer(path: str):
    if not os.path.isdir(path):
        return None
    from kvfit.text.tokenizer import load_tokenizer
    return load_tokenizer(path)


def _eos_ids(path: str, facts, tokenizer) -> tuple[int, ...]:
    """The ids that end a request, as vLLM gathers them: the tokenizer's eos_token first (vLLM's eos_token_id), then
    generation_config.json's eos_token_id (else config.json's), which vLLM adds as stop token ids."""
    from kvfit.text.generation_config import load_generation_eos
    primary = [] if tokenizer is None or tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    return tuple(dict.fromkeys(primary + load_generation_eos(path if os.path.isdir(path) else None, facts)))


def _generation_defaults(config: EngineConfig) -> dict:
    """Default sampling params from --generation-config (vLLM's names), checked by SamplingParams;
    logged once when there are any, as vLLM does."""
    from kvfit.text.generation_config import generation_config_path, load_generation_defaults
    model, source = config.model.model, config.model.generation_config
    path = generation_config_path(model if os.path.isdir(model) else None, source)
    defaults = load_generation_defaults(path)
    try:
        SamplingParams(**defaults)
    except RequestError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if defaults:
        logger.warning("default sampling params from %s (the model creator's; relaunch with --generation-config "
                       "vllm for vLLM's defaults): %s", path,
                       ", ".join(f"{k}={v}" for k, v in defaults.items()))
    return defaults
