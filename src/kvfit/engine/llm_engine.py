"""LLMEngine: start-up (load -> profile -> measure -> plan -> allocate) and the step loop."""

from __future__ import annotations

import itertools
import logging
import os
from typing import Callable

from kvfit.attention.registry import get_backend
from kvfit.config import EngineConfig
from kvfit.engine.output import Detokenizer, RequestOutput
from kvfit.engine.request import Request
from kvfit.engine.sampling_params import SamplingParams
from kvfit.engine.scheduler import Scheduler
from kvfit.engine.step_plan import StepPlan
from kvfit.errors import ConfigError, RequestError
from kvfit.kv.limits import spec_and_limits
from kvfit.kv.plan import KVPlan, plan_kv_cache
from kvfit.kv.pool import BlockPool
from kvfit.kv.report import write_plan_json
from kvfit.model_facts import load_model_facts
from kvfit.platforms.base import get_platform

logger = logging.getLogger("kvfit")


def _make_workers(config, facts, platform, backend, spec):
    if config.parallel.tensor_parallel_size > 1:
        from kvfit.runner.tp_executor import TensorParallelWorkers
        return TensorParallelWorkers(config, facts, platform, backend, spec)
    from kvfit.runner.worker import Worker
    return Worker(config, facts, platform, backend, spec)


# Decode steps per scheduling round on CUDA: the host's part of a step (schedule, inputs, update,
# outputs: about 1 ms at batch 1 and 4 ms at batch 256 on the H200 host, benchmarks/profile_kernels.py)
# is paid once per round instead of once per token, while a new request waits at most one round.
CUDA_SCHEDULER_STEPS = 8


def _scheduler_steps(config: EngineConfig, platform_name: str) -> int:
    steps = config.scheduler.num_scheduler_steps
    tp = config.parallel.tensor_parallel_size
    if steps is None:
        return CUDA_SCHEDULER_STEPS if platform_name == "cuda" and tp == 1 else 1
    if steps > 1 and tp > 1:
        raise ConfigError(f"--num-scheduler-steps {steps} needs --tensor-parallel-size 1 (got {tp}); "
                          "use --num-scheduler-steps 1 with tensor parallelism")
    return steps


class LLMEngine:
    """Owns the scheduler, the block pool and the workers; step() runs one batch."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.facts = load_model_facts(config.model.model)
        platform = get_platform(config.device.device)
        backend = get_backend(config.device.attention_backend or platform.default_backend)
        if backend.name == "triton" and platform.name != "cuda":
            raise ConfigError("--attention-backend triton needs --device cuda; use --attention-backend torch on CPU")
        self.device_name = platform.name
        self.num_scheduler_steps = _scheduler_steps(config, platform.name)
        self.spec, self.limits = spec_and_limits(self.facts, config, backend.max_element_offset, backend.name)
        self.workers = _make_workers(config, self.facts, platform, backend, self.spec)
        try:
            readings = self.workers.measure()
            self.readings = readings if isinstance(readings, list) else [readings]
            self.plan: KVPlan = plan_kv_cache(self.readings, self.spec, self.limits,
                                              config.parallel.tensor_parallel_size)
            logger.info(self.plan.log_line())
            for warning in self.plan.warnings:
                logger.warning(warning)
            if config.cache.plan_json:
                write_plan_json(self.plan, config.cache.plan_json, {"model": config.model.model})
            self.workers.initialize_cache(self.plan.num_blocks)
        except BaseException:
            self.workers.shutdown()
            raise
        self.pool = BlockPool(self.plan.num_blocks, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(self.pool, self.spec.block_size, self.limits.max_model_len,
                                   config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens)
        self.tokenizer = self._load_tokenizer()
        self.detokenizer = Detokenizer(self.tokenizer)
        self.eos_token_ids = self._eos_ids()
        self._prompts: dict[str, str | None] = {}
        self._ids = itertools.count()

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
            raise RequestError("this model has no tokenizer (tokenizer.json); pass prompt token ids instead of text")
        return self.tokenizer.encode(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Queue a prompt (text or token ids); raise RequestError if it can never be served."""
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; use stop_token_ids with this model")
        if isinstance(prompt, str):
            ids = self.encode(prompt)
        else:
            ids = list(prompt)
            if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
                raise RequestError("a token-id prompt must be a list of integers")
        vocab = self.facts.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise RequestError(f"prompt token ids must be in [0, {vocab}); got one outside")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        self.scheduler.add(Request(request_id=request_id, prompt_token_ids=ids, params=params,
                                   eos_token_ids=self.eos_token_ids))
        self._prompts[request_id] = prompt if isinstance(prompt, str) else None
        return request_id

    def abort(self, request_id: str) -> bool:
        """Abort a request; its blocks are freed at once. False if it was not active."""
        self._prompts.pop(request_id, None)
        return self.scheduler.finish(request_id, "abort") is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # the loop -----------------------------------------------------------------------------------
    def step(self, stream: bool = True) -> list[RequestOutput]:
        """Schedule, execute, update; return an output for every request that got tokens
        (stream=False: for the requests that finished only, so no text is decoded before the end).

        A multi-step plan (--num-scheduler-steps) returns several tokens per request; they are
        applied one at a time, in order, so stops and stop strings end a request at the same
        token as single steps would (tokens sampled past the end are dropped).
        """
        plan = self.scheduler.schedule(self.num_scheduler_steps)
        if plan.empty:
            # only possible with nothing running and a head request that cannot get blocks,
            # which add() rules out; fail loudly rather than spin
            assert not self.scheduler.waiting, "scheduler made no progress with requests waiting"
            return []
        if plan.num_steps == 1:
            return self._apply(plan, self.workers.execute(plan), 0, lambda _: stream)
        tokens = self.workers.execute_steps(plan)
        outputs = []
        for k in range(plan.num_steps):
            sampled = {rid: toks[k] for rid, toks in tokens.items() if k < len(toks)}
            outputs.extend(self._apply(plan, sampled, k, lambda rid, k=k: stream and k + 1 == len(tokens[rid])))
        return outputs

    def _apply(self, plan: StepPlan, sampled: dict[str, int], step: int,
               is_last: Callable[[str], bool]) -> list[RequestOutput]:
        """Apply step `step` of the plan; outputs for requests that finished or that is_last(request_id)
        asks for (their last token of the plan, when streaming). Stop strings are checked every token."""
        running = {rid: self.scheduler.requests.get(rid) for rid in sampled}
        finished = {r.request_id for r in self.scheduler.update(plan, sampled, step)}
        outputs = []
        for request_id, req in running.items():
            if req is None:
                continue
            done = request_id in finished
            wanted = is_last(request_id)
            if done or wanted or req.params.stop:
                out = self._output(req, done)          # a stop string found here finishes the request
                if out.finished or wanted:
                    outputs.append(out)
        return outputs

    def _output(self, req: Request, finished: bool) -> RequestOutput:
        full = self.detokenizer.tokenizer is not None and finished
        text = self.tokenizer.decode(req.output_token_ids) if full else self.detokenizer.text(req.output_token_ids)
        at = Detokenizer.find_stop(text, req.params.stop) if req.params.stop else None
        if at is not None:
            text = text[:at]
            if not finished:          # a stop string ends the request (it is left out of the text)
                self.scheduler.finish(req.request_id, "stop")
                finished = True
        prompt = self._prompts.pop(req.request_id, None) if finished else self._prompts.get(req.request_id)
        return RequestOutput(request_id=req.request_id, prompt=prompt, prompt_token_ids=req.prompt_token_ids,
                             text=text, token_ids=list(req.output_token_ids), finished=finished,
                             finish_reason=req.finish_reason if finished else None,
                             num_cached_tokens=req.num_cached_prompt_tokens)

    def stats(self) -> dict:
        pool, sched = self.pool, self.scheduler
        return {"kv_blocks_total": pool.num_blocks, "kv_blocks_free": pool.num_free_blocks,
                "kv_blocks_used": pool.num_used_blocks, "kv_blocks_cached": pool.num_cached_blocks,
                "token_capacity": self.plan.token_capacity, "running": len(sched.running),
                "waiting": len(sched.waiting), "preemptions": sched.num_preemptions,
                "prefix_cache_queries": sched.num_prefix_queries, "prefix_cache_hits": sched.num_prefix_hits}

    def shutdown(self) -> None:
        self.workers.shutdown()
