"""LLMEngine: admission, the step loop (schedule -> execute -> apply tokens -> outputs), stats.

Start-up happens before, in engine/startup.py; the engine wires what it produced to a scheduler,
a KV cache manager and an output processor.
"""

from __future__ import annotations

import itertools
import logging
import os

from kvfit.config import EngineConfig
from kvfit.engine.admission import check_request
from kvfit.engine.output import RequestOutput
from kvfit.engine.output_processor import OutputProcessor
from kvfit.engine.request import Request
from kvfit.engine.scheduler import Scheduler
from kvfit.engine.startup import start_engine
from kvfit.errors import RequestError
from kvfit.kv.manager import KVCacheManager
from kvfit.kv.pool import BlockPool
from kvfit.sampling_params import SamplingParams
from kvfit.step import NONFINITE_TOKEN, SampledTokens, StepDelta

logger = logging.getLogger("kvfit")


class LLMEngine:
    """Owns the scheduler, the KV cache manager, the output processor and the executor."""

    def __init__(self, config: EngineConfig):
        started = start_engine(config)
        self.config = config
        self.facts, self.platform, self.spec, self.limits = started.facts, started.platform, started.spec, started.limits
        self.workers = started.executor
        self.readings, self.plan = started.readings, started.plan
        self.num_scheduler_steps = started.num_scheduler_steps
        self.pool = BlockPool(self.plan.num_blocks, config.cache.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, self.spec.block_size)
        self.scheduler = Scheduler(self.kv, self.limits.max_model_len, config.scheduler.max_num_seqs,
                                   config.scheduler.max_num_batched_tokens)
        self.tokenizer = self._load_tokenizer()
        self.outputs = OutputProcessor(self.tokenizer)
        self.eos_token_ids = self._eos_ids()
        self._ids = itertools.count()

    @property
    def device_name(self) -> str:
        return self.platform.name

    def _load_tokenizer(self):
        path = self.config.model.model
        if not os.path.isdir(path):
            return None
        from kvfit.models.tokenizer import load_tokenizer
        return load_tokenizer(path)

    def _eos_ids(self) -> tuple[int, ...]:
        from kvfit.models.loader import load_generation_eos
        path = self.config.model.model
        return tuple(load_generation_eos(path if os.path.isdir(path) else None, self.facts))

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    # requests -----------------------------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer (tokenizer.json); pass prompt token ids instead of text",
                               "prompt")
        return self.tokenizer.encode(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    strict_context: bool = False) -> str:
        """Queue a prompt (text or token ids); raise RequestError if it can never be served.

        strict_context: prompt + max_tokens past --max-model-len is an error rather than a cut."""
        if isinstance(params, SamplingParams) and params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; use stop_token_ids with this model", "stop")
        if not isinstance(prompt, (str, list, tuple)):
            raise RequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}",
                               "prompt")
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        max_total = check_request(ids, params, self.facts.vocab_size, self.max_model_len, self.spec.block_size,
                                  self.pool.num_blocks, strict_context)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.scheduler.requests:
            raise RequestError(f"request id {request_id!r} is already in use", "request_id")
        req = Request(request_id=request_id, prompt_token_ids=ids, params=params, eos_token_ids=self.eos_token_ids,
                      max_total_tokens=max_total)
        self.scheduler.add(req)
        self.outputs.add(req, prompt if isinstance(prompt, str) else None)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Abort a request; its blocks are freed at once. False if it was not active."""
        self.outputs.drop(request_id)
        return self.scheduler.finish(request_id, "abort") is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # the loop -----------------------------------------------------------------------------------
    def step(self, stream: bool = True) -> list[RequestOutput]:
        """Schedule, execute, apply; return an output for every request that got tokens
        (stream=False: for the requests that finished only, so no text is built for callers early).

        A multi-step delta (--num-scheduler-steps) returns several tokens per request; they are
        applied one at a time, in order, so stops and stop strings end a request at the same
        token as single steps would (tokens sampled past the end are dropped).
        """
        delta = self.scheduler.schedule(self.num_scheduler_steps)
        if delta.empty:
            # with requests waiting, only possible when the head request cannot get blocks with
            # nothing running, which admission rules out: fail loudly rather than spin
            assert not self.scheduler.waiting, "scheduler made no progress with requests waiting"
            if delta.removed_ids:       # ended requests: the runner still drops their rows
                self.workers.execute(delta)
            return []
        tokens = self.workers.execute(delta)
        outputs: dict[str, RequestOutput] = {}
        for k in range(delta.max_num_steps):
            self._apply(delta, tokens, k, stream, outputs)
        return list(outputs.values())

    def _apply(self, delta: StepDelta, tokens: SampledTokens, step: int, stream: bool,
               outputs: dict[str, RequestOutput]) -> None:
        """Apply step `step` of the delta: record tokens, decide finishes, make outputs (a finished
        request's, and when streaming each request's after its last token of the delta)."""
        sampled = {rid: toks[step] for rid, toks in tokens.items() if step < len(toks)}
        for request_id in [rid for rid, token in sampled.items() if token == NONFINITE_TOKEN]:
            del sampled[request_id]
            req = self.scheduler.requests.get(request_id)
            if req is not None and not req.finished:        # this request fails alone
                logger.warning("request %s: the model's logits were not finite; ending it (finish reason "
                               "'error')", request_id)
                self.scheduler.finish(request_id, "error")
                outputs[request_id] = self.outputs.output(req, finished=True)
        for req in self.scheduler.update(delta, sampled, step):
            reason = self.outputs.finish_reason(req)
            if reason is not None:
                self.scheduler.finish(req.request_id, reason)
                outputs[req.request_id] = self.outputs.output(req, finished=True)
            elif stream and step + 1 == len(tokens[req.request_id]):
                outputs[req.request_id] = self.outputs.output(req, finished=False)

    def stats(self) -> dict:
        pool, sched = self.pool, self.scheduler
        return {"kv_blocks_total": pool.num_blocks, "kv_blocks_free": pool.num_free_blocks,
                "kv_blocks_used": pool.num_used_blocks, "kv_blocks_cached": pool.num_cached_blocks,
                "token_capacity": self.plan.token_capacity, "running": len(sched.running),
                "waiting": len(sched.waiting), "preemptions": sched.num_preemptions,
                "prefix_cache_queries": sched.num_prefix_queries, "prefix_cache_hits": sched.num_prefix_hits}

    def shutdown(self) -> None:
        self.workers.shutdown()
