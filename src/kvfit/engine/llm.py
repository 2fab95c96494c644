"""The offline API: LLM(model, ...).generate(prompts, params)."""

from __future__ import annotations

import logging
import os
import threading
from typing import Sequence

from tqdm.auto import tqdm

from kvfit.config import EngineConfig
from kvfit.engine.llm_engine import LLMEngine
from kvfit.engine.output import RequestOutput
from kvfit.sampling_params import SamplingParams
from kvfit.errors import RequestError


class LLM:
    """Load a model once, then generate for batches of prompts with continuous batching.

    Keyword arguments are the config settings (vLLM's names): dtype, device, max_model_len,
    block_size, gpu_memory_utilization, kv_cache_memory, num_gpu_blocks_override, max_num_blocks,
    kv_cache_dtype, enable_prefix_caching, max_num_seqs, max_num_batched_tokens,
    tensor_parallel_size, load_format, seed, attention_backend, enforce_eager, plan_json.
    """

    def __init__(self, model: str | os.PathLike, **kwargs):
        self.config = EngineConfig.from_kwargs(os.fspath(model) if isinstance(model, os.PathLike) else model,
                                               **kwargs)
        # one engine, one caller at a time: generate() from several threads runs them in turn
        self._lock = threading.Lock()
        logging.getLogger("kvfit").setLevel(logging.INFO)
        self.engine = LLMEngine(self.config)

    @property
    def capacity(self):
        """The KV plan this engine was started with (kvfit.kv.plan.KVPlan)."""
        return self.engine.plan

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order.

        Thread-safe: calls from several threads run one after another (the engine has one batch)."""
        prompts = _prompt_list(prompts)
        with self._lock:
            return self._generate(prompts, sampling_params, use_tqdm)

    def _generate(self, prompts: list, sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise RequestError(f"got {len(params)} sampling params for {len(prompts)} prompts; give one or one each")
        engine = self.engine
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(engine.add_request(prompt, p))
        except BaseException:
            for request_id in ids:
                engine.abort(request_id)
            raise
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm)
        try:
            while len(done) < len(ids):
                for out in engine.step(stream=False):
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for request_id in ids:
                if request_id not in done:
                    engine.abort(request_id)
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]

    def shutdown(self) -> None:
        with self._lock:
            self.engine.shutdown()


def _prompt_list(prompts) -> list:
    """One prompt (text or token ids) or a sequence of them -> a list of prompts; anything else is a
    RequestError (bytes are not token ids, None is not a prompt)."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Sequence):
        raise RequestError(f"prompts must be a string, a list of token ids, or a list of those; got "
                           f"{type(prompts).__name__}", "prompt")
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]
    for prompt in prompts:
        if isinstance(prompt, str):
            continue
        if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence) or any(
                isinstance(t, bool) or not isinstance(t, int) for t in prompt):
            raise RequestError(f"each prompt must be a string or a list of token ids (ints); got "
                               f"{type(prompt).__name__}", "prompt")
    return prompts
