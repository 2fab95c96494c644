"""The offline API: LLM(model, ...).generate(prompts, params)."""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable, Sequence

import torch
from tqdm.auto import tqdm

from kvfit.config import EngineConfig, setting_names
from kvfit.hub import resolve_model_name
from kvfit.engine.admission import are_token_ids, check_cache_salt
from kvfit.engine.llm_engine import LLMEngine
from kvfit.engine.output import RequestOutput
from kvfit.sampling_params import SamplingParams, as_python
from kvfit.errors import ConfigError, RequestError
from kvfit.text.chat_template import (as_text_parts, detected_content_format, text_parts_joined,
                                      tool_arguments_as_objects)

# vLLM's LLM(...) keyword arguments that kvfit has no setting for: the values that ask for what kvfit
# does anyway (accepted), and why another value cannot be honoured (a ConfigError). tokenizer and
# swap_space are checked on their own (_check_vllm_kwargs).
VLLM_KWARGS: dict[str, tuple[tuple, str]] = {
    "trust_remote_code": ((False, True), "kvfit never runs code from a model folder"),
    "hf_overrides": ((None, {}), "config.json is read as it is; edit a copy of the folder"),
    "disable_log_stats": ((True,), "LLM logs no periodic stats (kvfit serve has /metrics and a stats line)"),
    "skip_tokenizer_init": ((False,), "a model folder without tokenizer.json runs without a tokenizer "
                                      "(token-id prompts)"),
    "tokenizer_mode": (("auto", "hf"), "tokenizer.json is read as transformers' fast tokenizer reads it"),
    "enable_chunked_prefill": ((None, True), "long prompts are always split into max_num_batched_tokens chunks"),
    "pipeline_parallel_size": ((1,), "pipeline parallelism is not implemented; use tensor_parallel_size"),
    "data_parallel_size": ((1,), "data parallelism is not implemented"),
    "cpu_offload_gb": ((0,), "weights are not offloaded"),
    "enable_lora": ((False, None), "LoRA adapters are not implemented"),
    "speculative_config": ((None,), "speculative decoding is not implemented"),
    "task": (("auto", "generate"), "only text generation is served (no pooling or embedding models)"),
    "runner": (("auto", "generate"), "only text generation is served (no pooling or embedding models)"),
    "download_dir": ((None,), "models are never downloaded; fetch one with `hf download`"),
    "distributed_executor_backend": ((None, "mp"), "tensor-parallel ranks run as processes of this host (mp)"),
}


class LLM:
    """Load a model once, then generate for batches of prompts with continuous batching.

    Keyword arguments are the config settings (vLLM's names): dtype, device, max_model_len,
    block_size, gpu_memory_utilization, kv_cache_memory (or vLLM's kv_cache_memory_bytes),
    num_gpu_blocks_override, max_num_blocks, kv_cache_dtype, enable_prefix_caching, max_num_seqs,
    max_num_batched_tokens, tensor_parallel_size, load_format, seed, attention_backend, enforce_eager,
    disable_cascade_attn, plan_json, generation_config, max_logprobs, quantization.
    """

    def __init__(self, model: str | os.PathLike, **kwargs):
        """model: a folder, a Hugging Face id found in the local cache (HF_HUB_CACHE / HF_HOME; never
        downloaded; at `revision`, default main), or a catalog name (with load_format="dummy"). vLLM's
        keyword arguments without a kvfit setting (VLLM_KWARGS, tokenizer, swap_space) are accepted
        where kvfit does what they ask, else a ConfigError says why."""
        # numpy / torch values converted once here; None for a setting is its default, as in vLLM (seed=None: 0, vLLM v1's)
        kwargs = {k: as_python(v) for k, v in kwargs.items() if v is not None or k not in setting_names()}
        if isinstance(kwargs.get("dtype"), torch.dtype):           # LLM(dtype=torch.float16), as vLLM takes it
            kwargs["dtype"] = str(kwargs["dtype"]).removeprefix("torch.")
        vllm_kwargs = {k: kwargs.pop(k) for k in [*VLLM_KWARGS, "tokenizer", "swap_space"] if k in kwargs}
        _check_vllm_kwargs(vllm_kwargs)
        memory_bytes = kwargs.pop("kv_cache_memory_bytes", None)     # vLLM's name of kv_cache_memory
        if memory_bytes is not None:
            if "kv_cache_memory" in kwargs:
                raise ConfigError("give kv_cache_memory or kv_cache_memory_bytes (vLLM's name for it), not both")
            kwargs["kv_cache_memory"] = memory_bytes
        config = EngineConfig.from_kwargs(model, **kwargs)     # resolves the model once, at its revision
        _check_tokenizer(vllm_kwargs.get("tokenizer"), config.model.model)
        self._start(config)

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        """The LLM of a built config (its model already resolved: `kvfit generate` builds it once)."""
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        self.config = config
        # one engine, one caller at a time: generate() from several threads runs them in turn
        self._lock = threading.Lock()
        logging.getLogger("kvfit").setLevel(logging.INFO)
        self.engine = LLMEngine(self.config)

    @property
    def capacity(self):
        """The KV plan this engine was started with (kvfit.kv.plan.KVPlan)."""
        return self.engine.plan

    @property
    def llm_engine(self):
        """vLLM's name of the engine LLM runs (kvfit's LLMEngine; also `engine`)."""
        return self.engine

    def get_tokenizer(self):
        """The model's tokenizer (kvfit.text.tokenizer.Tokenizer: encode, decode, apply_chat_template)."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the params generate and chat use when given none: SamplingParams() with the defaults
        of --generation-config (generation_config, default auto: the model's generation_config.json)."""
        return SamplingParams(**self.engine.default_sampling_params)

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable = True, lora_request=None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order (vLLM's shapes).

        prompts: a text, a list of token ids, {"prompt": text} or {"prompt_token_ids": ids} (either dict
        may add "cache_salt": a non-empty string; the prompt then shares prefix-cache blocks only with
        prompts of the same salt), or a list of those; sampling_params: one for every prompt or a list with one per prompt (default
        get_default_sampling_params()). A token-ids dict may also hold the "prompt" text it came from (the output's
        prompt, vLLM's TokensPrompt), and "multi_modal_data" / "mm_processor_kwargs" as None. use_tqdm: a bool, or a
        tqdm-like class to make the progress bar with (vLLM's); lora_request: None (LoRA is not implemented).
        Thread-safe: calls from several threads run one after another (one batch)."""
        _check_no_lora(lora_request)
        prompts = _prompt_list(prompts)
        with self._lock:
            outputs = self._generate([(value, salt) for value, salt, _ in prompts], sampling_params, use_tqdm)
        for output, (_, _, text) in zip(outputs, prompts):
            if text is not None:
                output.prompt = text
        return outputs

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool | Callable = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None, lora_request=None,
             chat_template_content_format: str = "auto") -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or a list of them.

        Each is rendered with the model's chat template (or chat_template, a template text) to token ids
        as transformers' apply_chat_template(tokenize=True) gives them (no second bos). tools: OpenAI
        function tools for the template (vLLM's); assistant tool_calls reach it with their arguments as
        objects. The outputs are text: the server's --tool-call-parser reads tool calls out of it.
        chat_template_content_format (vLLM's): "string" (text parts joined by a line break), "openai" (content as a
        list of text parts) or "auto" (openai for a template that loops over a message's content)."""
        _check_no_lora(lora_request)
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise RequestError("chat needs a tokenizer (tokenizer.json), which this model folder lacks", "messages")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise RequestError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts", "messages")
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise RequestError(f"chat_template_content_format must be auto, string or openai, got "
                               f"{chat_template_content_format!r:.40}", "chat_template_content_format")
        content_format = chat_template_content_format
        source = chat_template if chat_template is not None else tokenizer.chat_template
        if content_format == "auto":
            content_format = detected_content_format(source) if isinstance(source, str) else "string"
        as_content = as_text_parts if content_format == "openai" else text_parts_joined
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts, texts = [], []
        for conversation in conversations:
            if not isinstance(conversation, (list, tuple)) or not all(isinstance(m, dict) for m in conversation):
                raise RequestError("each conversation must be a list of {'role': ..., 'content': ...} dicts",
                                   "messages")
            text = tokenizer.apply_chat_template(
                tool_arguments_as_objects(as_content(list(conversation))), add_generation_prompt,
                continue_final_message=continue_final_message, chat_template=chat_template,
                template_kwargs=chat_template_kwargs, **({"tools": tools} if tools is not None else {}))
            texts.append(text)
            # as apply_chat_template(tokenize=True): the template wrote its own special tokens
            prompts.append((tokenizer.encode(text, add_special_tokens=False), None))
        with self._lock:
            outputs = self._generate(prompts, sampling_params, use_tqdm)
        for output, text in zip(outputs, texts):
            output.prompt = text            # vLLM's: the rendered conversation
        return outputs

    def _generate(self, prompts: list[tuple], sampling_params, use_tqdm: bool | Callable) -> list[RequestOutput]:
        """prompts: (text or token ids, cache_salt or None) pairs."""
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise RequestError(f"got {len(params)} sampling params for {len(prompts)} prompts; give one or one each",
                               "sampling_params")
        _check_grammars(params)
        engine = self.engine
        ids = []
        try:
            for (prompt, cache_salt), p in zip(prompts, params):
                ids.append(engine.add_request(prompt, p, cache_salt=cache_salt))
        except BaseException:
            for request_id in ids:
                engine.abort(request_id)
            raise
        done: dict[str, RequestOutput] = {}
        if callable(use_tqdm):          # vLLM's: a callable makes the bar, called with vLLM's keywords
            bar = use_tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, postfix="")
        else:
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

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """vLLM's: forget every cached prefix, so later prompts compute all their tokens. Returns False (and
        logs a warning) while requests hold blocks. Preempting running requests to force the reset, and KV
        connectors, are not supported (a ValueError)."""
        if reset_running_requests or reset_connector:
            raise ValueError("reset_prefix_cache: reset_running_requests and reset_connector are not supported; "
                             "call it with no arguments when no request is running")
        with self._lock:
            return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        with self._lock:
            self.engine.shutdown()


def _check_grammars(params: list) -> None:
    """The offline front end's grammar check (the server's is in its prepare step): a grammar llguidance
    refuses is a RequestError here, before any request is added (the engine compiles it later, off its
    thread, and would only end the request with finish reason 'error')."""
    specs = {p.structured_outputs.key: p.structured_outputs for p in params
             if isinstance(p, SamplingParams) and p.structured_outputs is not None}
    if specs:
        from kvfit.structured.grammar import check_spec
        for spec in specs.values():
            check_spec(spec)


def _check_vllm_kwargs(kwargs: dict) -> None:
    for name, value in kwargs.items():
        if name == "tokenizer":
            continue
        if name == "swap_space":         # accepted: preemption recomputes (vLLM v1's way), nothing is swapped
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"swap_space must be a number of GiB >= 0, got {value!r:.40}")
            continue
        accepted, reason = VLLM_KWARGS[name]
        if not any(value is a or (type(value) is type(a) and value == a) for a in accepted):
            raise ConfigError(f"LLM({name}={value!r:.60}) is not supported by kvfit: {reason}")


def _check_tokenizer(tokenizer, model_path: str) -> None:
    """vLLM's tokenizer= must name the model's own folder: kvfit reads the tokenizer from there."""
    if tokenizer is None:
        return
    name = os.fspath(tokenizer) if isinstance(tokenizer, os.PathLike) else tokenizer
    if not isinstance(name, str) or os.path.realpath(resolve_model_name(name)) != os.path.realpath(model_path):
        raise ConfigError(f"LLM(tokenizer={name!r:.80}) is not the model's folder; kvfit reads the tokenizer from "
                          f"the model folder ({model_path}): leave tokenizer out")


def _token_ids(value) -> list[int] | None:
    """value as a list of token ids (a numpy or torch array, or a sequence holding numpy or torch ints,
    converted once here), or None when it is no sequence of integers."""
    if type(value).__module__.partition(".")[0] in ("numpy", "torch"):
        value = as_python(value)
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes, bytearray)):
        return None
    ids = list(value)
    if not are_token_ids(ids):
        ids = [as_python(t) for t in ids]
    return ids if are_token_ids(ids) else None


def _refuse_non_int_ids(value) -> None:
    """A RequestError naming the type of the first non-integer of a would-be token-id list (a list or
    array of numbers, some not integers: floats, bools); nothing for anything else."""
    value = as_python(value)
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, (int, float)) for v in value):
        return
    bad = next(t for t in value if not isinstance(t, int) or isinstance(t, bool))
    raise RequestError(f"prompt token ids must be integers, got {type(bad).__name__} {bad!r:.20}", "prompt")


def _check_no_lora(lora_request) -> None:
    if lora_request is not None:
        raise ConfigError("lora_request: LoRA adapters are not implemented in kvfit; leave it out (or None)")


MULTIMODAL_PROMPT_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids")


def _one_prompt(prompt) -> tuple[str | list[int], str | None, str | None]:
    """A text, token ids, {"prompt": text} or {"prompt_token_ids": ids} (a dict may add "cache_salt"; a token-ids
    dict the "prompt" text it came from; any dict the multimodal keys as None) -> (text or token ids, cache_salt or
    None, the token ids' text or None)."""
    if isinstance(prompt, dict):
        media = [k for k in MULTIMODAL_PROMPT_KEYS if prompt.get(k) is not None]
        if media:
            raise RequestError(f"prompt {media[0]}: kvfit serves text models only; leave it out (or None)", "prompt")
        keys = set(prompt) - {"cache_salt", *MULTIMODAL_PROMPT_KEYS}
        cache_salt = check_cache_salt(prompt.get("cache_salt"))
        if keys == {"prompt"} and isinstance(prompt["prompt"], str):
            return prompt["prompt"], cache_salt, None
        text = prompt.get("prompt")
        ids = None
        if keys in ({"prompt_token_ids"}, {"prompt_token_ids", "prompt"}) and (text is None or isinstance(text, str)):
            ids = _token_ids(prompt["prompt_token_ids"])
        if ids is not None:
            return ids, cache_salt, text
        raise RequestError('a prompt dict must be {"prompt": text} or {"prompt_token_ids": [ids]} (and the "prompt" '
                           f'text they came from), with an optional "cache_salt"; got {_describe(prompt)}', "prompt")
    if isinstance(prompt, str):
        return prompt, None, None
    ids = _token_ids(prompt)
    if ids is not None:
        return ids, None, None
    _refuse_non_int_ids(prompt)
    raise RequestError('each prompt must be a string, a list of token ids (ints), {"prompt": text} or '
                       f'{{"prompt_token_ids": ids}}; got {type(prompt).__name__}', "prompt")


def _describe(prompt: dict) -> str:
    return "{" + ", ".join(f"{k!r}: {type(v).__name__}" for k, v in list(prompt.items())[:4]) + "}"


def _prompt_list(prompts) -> list:
    """One prompt (text, token ids or a prompt dict) or a sequence of them -> a list of (text or token
    ids, cache_salt, the token ids' text) triples; anything else is a RequestError (bytes are not token ids, None is not a prompt)."""
    if isinstance(prompts, (str, dict)):
        return [_one_prompt(prompts)]
    if type(prompts).__module__.partition(".")[0] in ("numpy", "torch"):   # an array: ids, or a batch of them
        prompts = as_python(prompts)
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Sequence):
        raise RequestError(f"prompts must be a string, a list of token ids, a prompt dict, or a list of those; got "
                           f"{type(prompts).__name__}", "prompt")
    prompts = list(prompts)
    ids = _token_ids(prompts) if prompts else None
    if ids is not None:
        return [(ids, None, None)]
    _refuse_non_int_ids(prompts)
    return [_one_prompt(p) for p in prompts]
