"""Command-line flags shared by the subcommands; they map one to one onto config fields (vLLM's names)."""

from __future__ import annotations

import argparse
import json
import os
import re

from kvfit.errors import ConfigError


def _positive_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


INT64_MAX = 2**63 - 1


def _seed(text: str) -> int:
    """--seed: the one range check of the engine seed given on the command line."""
    try:
        value = int(text)
    except ValueError:   # not an integer, or past Python's 4,300 digits
        value = None
    from kvfit.config import MAX_SEED
    if value is None or not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**64 - 1], got {text[:40]!r}")
    return value


def int_flag(text: str) -> int:
    """An integer flag: it must fit int64, since torch holds every count and id as int64 (range checks
    beyond that belong to the config field the flag sets)."""
    try:
        value = int(text)
    except ValueError:   # not an integer, or past Python's 4,300 digits
        raise argparse.ArgumentTypeError(f"expected an integer, got {text[:40]!r}") from None
    if not -INT64_MAX - 1 <= value <= INT64_MAX:
        raise argparse.ArgumentTypeError(f"{text[:40]} is out of range; use an integer below 2**63")
    return value


# vLLM's human-readable integers: a lowercase suffix is decimal, an uppercase one binary
_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def max_model_len_flag(text: str) -> int | str:
    """--max-model-len as vLLM reads it: an integer, 32k (32,000; decimals allowed) or 32K (32,768; no
    decimals), or auto / -1: the longest request the KV cache holds."""
    value = text.strip()
    if value.lower() == "auto" or value == "-1":
        return "auto"
    return human_int_flag(value)


def human_int_flag(text: str) -> int:
    """An integer as vLLM's human_readable_int reads it: 4096, 8k (8,000; decimals allowed) or 8K (8,192)."""
    value = text.strip()
    try:
        if value[-1:] in _BINARY_SUFFIXES:
            number = int(value[:-1]) * _BINARY_SUFFIXES[value[-1]]
        elif value[-1:] in _DECIMAL_SUFFIXES:
            number = int(float(value[:-1]) * _DECIMAL_SUFFIXES[value[-1]])
        else:
            number = int(value)
    except (ValueError, OverflowError):   # not a number, inf/nan, or past Python's 4,300 digits
        raise argparse.ArgumentTypeError(f"expected an integer like 4096, 32k or 32K (or auto for --max-model-len), "
                                         f"got {text[:40]!r}") from None
    return int_flag(str(number))


def add_model_argument(p: argparse.ArgumentParser, what: str) -> None:
    """The MODEL positional (or vLLM's --model), --revision and the model flags of vLLM scripts, of
    every command that reads a model."""
    p.add_argument("model", metavar="MODEL", nargs="?", default=None,
                   help=f"a model folder, a config.json, a Hugging Face id found in the local cache "
                        f"($HF_HUB_CACHE or ~/.cache/huggingface/hub; never downloaded), or {what}")
    p.add_argument("--model", dest="model_option", default=None, metavar="MODEL",
                   help="the model, as vLLM's --model spells it (instead of the positional MODEL; default: none)")
    p.add_argument("--revision", default=None,
                   help="branch, tag or commit of a Hugging Face id in the local cache (default: main)")
    p.add_argument("--tokenizer", dest="vllm_tokenizer", default=None, metavar="MODEL",
                   help="vLLM's: kvfit reads the tokenizer from the model folder, so it must name that folder "
                        "(default: the model's)")
    p.add_argument("--trust-remote-code", dest="vllm_trust_remote_code", action="store_true",
                   help="vLLM's; accepted and changes nothing: kvfit never runs code from a model folder (its "
                        "architectures are built in), so no model needs it")
    refuse(p, "--hf-overrides", "config.json is read as it is; edit a copy of the folder", ("{}",))
    refuse(p, "--tokenizer-mode", "tokenizer.json is read as transformers' fast tokenizer reads it",
           ("auto", "hf"))
    refuse(p, "--download-dir", "models are never downloaded; fetch one with `hf download`")
    refuse(p, "--model-impl", "kvfit runs its own implementation of each architecture (auto); it has no vLLM or "
           "transformers backend", ("auto",))
    refuse(p, "--config-format", "kvfit reads the model folder's Hugging Face config.json (auto, hf), not a "
           "Mistral params.json", ("auto", "hf"))


def model_argument(args: argparse.Namespace) -> None:
    """args.model from MODEL or --model (given once); a --tokenizer that names another folder is an error."""
    given = [m for m in (args.model, getattr(args, "model_option", None)) if m is not None]
    if not given:
        raise ConfigError(f"a model is required: kvfit {args.command} MODEL (or --model MODEL)")
    if len(given) == 2 and given[0] != given[1]:
        raise ConfigError(f"two models given: MODEL {given[0]!r} and --model {given[1]!r}; give one")
    args.model = given[0]
    tokenizer = getattr(args, "vllm_tokenizer", None)
    if tokenizer is not None and tokenizer != args.model:
        from kvfit.hub import resolve_model_name
        model_path = resolve_model_name(args.model, args.revision)
        if os.path.realpath(resolve_model_name(tokenizer)) != os.path.realpath(model_path):
            raise ConfigError(f"--tokenizer {tokenizer} is not the model's folder; kvfit reads the tokenizer from "
                              f"the model folder ({model_path}): drop --tokenizer or copy tokenizer files into it")


class _Refused(argparse.Action):
    """A vLLM flag kvfit cannot honour: a value in `neutral` (the one that asks for nothing) passes,
    any other is a one-line error that says why."""

    def __init__(self, option_strings, dest, reason: str, neutral: tuple = (), **kwargs):
        nargs = 0 if neutral is None else None
        shown = f"; accepted: {', '.join(neutral)}" if neutral else ""
        super().__init__(option_strings, dest, nargs=nargs, default=argparse.SUPPRESS,
                         metavar=None if nargs == 0 else "VALUE",
                         help=f"vLLM's; not supported: {reason}{shown}", **kwargs)
        self.reason, self.neutral = reason, neutral or ()

    def __call__(self, parser, namespace, values, option_string=None):
        if self.nargs == 0 or values not in self.neutral:
            shown = "" if self.nargs == 0 else f" {values}"
            raise ConfigError(f"{option_string}{shown} is not supported by kvfit: {self.reason}")


def refuse(p: argparse.ArgumentParser, flag: str, reason: str, neutral: tuple | None = (), aliases: tuple = ()) -> None:
    """Add vLLM's `flag` (and its short `aliases`), refused with `reason` unless its value is one of `neutral`
    (None: a switch, always refused)."""
    p.add_argument(flag, *aliases, action=_Refused, reason=reason, neutral=neutral,
                   dest="vllm_" + flag.lstrip("-").replace("-", "_"))


def add_vllm_engine_flags(p: argparse.ArgumentParser) -> None:
    """The engine flags of vLLM scripts that kvfit has no setting for: honoured where kvfit already does
    what they ask, refused with the reason where it cannot."""
    p.add_argument("--enable-chunked-prefill", dest="vllm_chunked_prefill", action=_ChunkedPrefill, nargs=0,
                   help="vLLM's; kvfit always splits long prompts into --max-num-batched-tokens chunks (on by "
                        "default; --no-enable-chunked-prefill is refused)")
    p.add_argument("--no-enable-chunked-prefill", dest="vllm_chunked_prefill", action=_ChunkedPrefill, nargs=0,
                   help=argparse.SUPPRESS)
    p.add_argument("--swap-space", dest="vllm_swap_space", type=float, default=None, metavar="GIB",
                   help="vLLM's; accepted, nothing is reserved: kvfit preempts by recomputing (as vLLM v1), so "
                        "no KV blocks are swapped to host memory (default: none)")
    refuse(p, "--pipeline-parallel-size", "pipeline parallelism is not implemented; use --tensor-parallel-size",
           ("1",), ("-pp",))
    refuse(p, "--data-parallel-size", "data parallelism is not implemented; run one server per device", ("1",),
           ("-dp",))
    refuse(p, "--cpu-offload-gb", "weights are not offloaded; use a smaller model or more devices", ("0",))
    refuse(p, "--distributed-executor-backend", "tensor-parallel ranks run as processes of this host", ("mp",))
    refuse(p, "--enable-lora", "LoRA adapters are not implemented", None)
    refuse(p, "--speculative-config", "speculative decoding is not implemented")
    refuse(p, "--kv-transfer-config", "KV transfer is not implemented")
    refuse(p, "--limit-mm-per-prompt", "only text models are served")
    refuse(p, "--task", "only text generation is served (no pooling or embedding models)", ("auto", "generate"))
    refuse(p, "--runner", "only text generation is served (no pooling or embedding models)", ("auto", "generate"))
    refuse(p, "--scheduling-policy", "kvfit schedules first come, first served (fcfs); it has no request priorities",
           ("fcfs",))
    refuse(p, "--logprobs-mode", "logprobs are the model's raw fp32 log-softmax, before temperature, penalties and "
           "any other processing but a structured output's mask (raw_logprobs)", ("raw_logprobs",))
    refuse(p, "--max-parallel-loading-workers", "each tensor-parallel rank reads only its slice of each weight, "
           "all ranks at once; there is no loading-worker setting")


def add_vllm_server_flags(p: argparse.ArgumentParser) -> None:
    """`vllm serve` flags of logging and TLS, mapped onto kvfit serve's logs or refused with the reason."""
    p.add_argument("--uvicorn-log-level", default=None,
                   choices=("critical", "error", "warning", "info", "debug", "trace"),
                   help="vLLM's: the level of uvicorn's own log lines (default: --log-level)")
    p.add_argument("--disable-log-requests", "--disable-uvicorn-access-log", dest="vllm_log_requests",
                   action="store_false", default=True,
                   help="vLLM's: no log line per request (kvfit's access line: method, path, status, tokens, "
                        "time; default: one per request at --log-level info)")
    p.add_argument("--no-enable-log-requests", dest="vllm_log_requests", action="store_false",
                   help="vLLM's: --disable-log-requests")
    p.add_argument("--enable-log-requests", dest="vllm_log_requests", action="store_true",
                   help="vLLM's: a log line per request: kvfit's access line, on by default (it never shows the "
                        "prompt)")
    p.add_argument("--disable-log-stats", dest="vllm_disable_log_stats", action="store_true",
                   help="vLLM's: no stats line (default: one every 10 s while requests run)")
    p.add_argument("--max-log-len", dest="vllm_max_log_len", type=int_flag, default=None, metavar="N",
                   help="vLLM's: the most prompt characters a log line shows; accepted, kvfit's log lines show no "
                        "prompt (default: none shown)")
    for flag in ("--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs"):
        refuse(p, flag, _NO_TLS)
    refuse(p, "--ssl-cert-reqs", _NO_TLS, ("0",))
    refuse(p, "--reasoning-parser", "there are no reasoning parsers; the model's reasoning stays in content")
    refuse(p, "--tool-parser-plugin", "the tool-call parsers are built in (--tool-call-parser)")
    refuse(p, "--api-server-count", "kvfit serve runs one HTTP front-end process beside its engine core process "
           "(bench_serve.py reports the front-end's CPU per token, which says when more would help)", ("1",))
    refuse(p, "--disable-frontend-multiprocessing", "the engine core always runs in its own process beside the HTTP "
           "front-end, so that no client can stall it", None)
    refuse(p, "--middleware", "kvfit imports no code named on the command line; its middleware is built in (CORS: "
           "--allowed-origins)")


_NO_TLS = "the server speaks plain HTTP; put a TLS-terminating proxy in front"


class _Json(argparse.Action):
    """A flag whose value is JSON, as vLLM's json.loads flags; check(value, flag) returns the value or raises a
    one-line ConfigError."""

    def __init__(self, option_strings, dest, check, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.check = check

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            value = json.loads(values)
        except (ValueError, RecursionError):
            raise ConfigError(f"{option_string} must be JSON, got {values[:60]!r}") from None
        setattr(namespace, self.dest, self.check(value, option_string))


def _strings(value, flag: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{flag} must be a JSON list of strings like '[\"*\"]', got {json.dumps(value)[:60]}")
    return value


def _generation_overrides(value, flag: str) -> dict:
    from kvfit.text.generation_config import generation_overrides
    return generation_overrides(value)


def add_vllm_frontend_flags(p: argparse.ArgumentParser) -> None:
    """`vllm serve`'s front-end flags that kvfit honours with vLLM's meaning (server/frontend.py)."""
    on_off = argparse.BooleanOptionalAction
    for name in ("origins", "methods", "headers"):
        p.add_argument(f"--allowed-{name}", type=str, action=_Json, check=_strings, default=["*"], metavar="JSON",
                       help=f"vLLM's: the CORS allowed {name}, a JSON list (default: [\"*\"], any)")
    for flag, what in (
            ("--allow-credentials", "CORS allows credentials (cookies, Authorization) from the allowed origins"),
            ("--disable-fastapi-docs", "no /docs, /redoc or /openapi.json; accepted and changes nothing: kvfit serves "
                                       "none of them"),
            ("--enable-request-id-headers", "every response carries an X-Request-Id header, the request's own "
                                            "X-Request-Id if it sent one, else a new random id"),
            ("--enable-prompt-tokens-details", "usage holds prompt_tokens_details.cached_tokens, the prompt tokens the "
                                               "prefix cache served (null when none)"),
            ("--enable-force-include-usage", "every stream carries usage as if stream_options asked for include_usage "
                                             "and continuous_usage_stats (responses that are not streamed always have "
                                             "it)"),
            ("--return-tokens-as-token-ids", "logprobs show each token as 'token_id:<id>' (a request's "
                                             "return_tokens_as_token_ids wins)"),
            ("--exclude-tools-when-tool-choice-none", "a chat with tool_choice none renders its template without its "
                                                      "tools")):
        p.add_argument(flag, action=on_off, default=False, help=f"vLLM's: {what}")
    p.add_argument("--chat-template-content-format", default="auto", choices=("auto", "string", "openai"),
                   help="vLLM's: how a message's content reaches the chat template: string (its text parts joined "
                        "by a line break), openai (a list of {'type': 'text', 'text': ...} parts; a tool message's "
                        "stays a string) or auto: openai for a template that loops over a message's content, else string, as "
                        "vLLM inspects the template")
    p.add_argument("--override-generation-config", action=_Json, check=_generation_overrides, default=None,
                   metavar="JSON",
                   help="vLLM's: default sampling params (generation_config.json's names: temperature, top_p, top_k, "
                        "min_p, repetition_penalty, max_new_tokens) merged over --generation-config's, or with "
                        "--generation-config vllm the only ones; null removes one (default: none)")


def apply_server_log_flags(args: argparse.Namespace) -> None:
    """--disable-log-requests: the access line off (its logger's level raised past info)."""
    import logging
    if not args.vllm_log_requests:
        logging.getLogger("kvfit.access").setLevel(logging.WARNING)


class _ChunkedPrefill(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        if option_string.startswith("--no-"):
            raise ConfigError("--no-enable-chunked-prefill is not supported by kvfit: it always splits long prompts "
                              "into chunks of --max-num-batched-tokens (raise it for fewer, larger chunks)")


class _KVCacheMemory(argparse.Action):
    """--kv-cache-memory, or vLLM's --kv-cache-memory-bytes (where a plain integer is bytes): one of them."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = getattr(namespace, "kv_cache_memory_flag", None)
        if given not in (None, option_string):
            raise ConfigError("give --kv-cache-memory or --kv-cache-memory-bytes (vLLM's name for it), not both")
        namespace.kv_cache_memory_flag = option_string
        if option_string == "--kv-cache-memory-bytes":
            from kvfit.units import parse_bytes
            text = values.strip()
            # vLLM's human_readable_int: a plain number is bytes; an upper-case K/M/G/T is binary (8G: 8 GiB), a
            # lower-case one decimal (kvfit's k/m/g/t already)
            if text.isdigit():
                text += "B"
            elif re.fullmatch(r"[0-9]+(\.[0-9]+)?[KMGT]", text):
                text += "iB"
            values = parse_bytes(text, option_string)
        setattr(namespace, self.dest, values)


def add_capacity_flags(p: argparse.ArgumentParser) -> None:
    """Flags that shape the KV plan (shared by plan, generate, serve, profile)."""
    p.add_argument("--gpu-memory-utilization", type=_positive_float, default=None,
                   help="fraction of GPU memory that may be in use while serving (GPU only: refused on the CPU, "
                        "whose KV cache takes 25%% of the available RAM unless --kv-cache-memory sizes it)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int_flag, default=None,
                   help="ranks the model is split over, one device each")
    p.add_argument("--block-size", type=int_flag, default=None, help="tokens per KV block (a power of two)")
    p.add_argument("--kv-cache-dtype", default=None, help="auto, bfloat16, float16, float32 or fp8 "
                                                           "(auto: the model's dtype)")
    p.add_argument("--calculate-kv-scales", action="store_true", default=None,
                   help="with --kv-cache-dtype fp8: set each layer's k/v cache scales from the first batch "
                        "(default: the checkpoint's kv_cache_scheme scales, else 1.0)")
    p.add_argument("--max-model-len", type=max_model_len_flag, default=None,
                   help="longest request (prompt + output) in tokens, e.g. 4096, 32k (32,000) or 32K (32,768); "
                        "auto (or -1): the longest that one request can hold in the KV cache, at most the "
                        "model's (default: the model's max_position_embeddings)")
    p.add_argument("--max-num-batched-tokens", type=human_int_flag, default=None,
                   help="tokens per engine step, and of the start-up profile's steps (default: 8192 on a GPU, "
                        "64 on the CPU)")
    p.add_argument("--max-num-seqs", type=int_flag, default=None, help="requests in the batch at once")
    p.add_argument("--num-gpu-blocks-override", type=int_flag, default=None,
                   help="use exactly this many KV blocks, which must fit in memory (default: as many as fit)")
    p.add_argument("--max-num-blocks", type=int_flag, default=None, help="a cap on KV blocks (default: none)")
    p.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", action=_KVCacheMemory, default=None, metavar="SIZE",
                   help="KV cache size with a unit, e.g. 20GiB; replaces the --gpu-memory-utilization budget "
                        "(--kv-cache-memory-bytes, vLLM's name, also takes a plain number of bytes and reads 8G as 8 "
                        "GiB, 8g as 8 GB, as vLLM; default: what the budget leaves on a GPU, 25%% of the available RAM "
                        "on the CPU)")
    p.add_argument("--dtype", default=None, help="auto, float32, bfloat16 or float16 (auto: the checkpoint's)")
    p.add_argument("--quantization", "-q", default=None,
                   help="fp8: quantize a 16-bit checkpoint's linear weights to FP8 at load (per output channel, "
                        "activations per token); fp8, compressed-tensors or modelopt on an FP8 checkpoint: its "
                        "quant_method (default: the checkpoint's own)")
    p.add_argument("--attention-backend", default=None, help="torch or triton (default: the platform's)")


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """Flags of a running engine (generate, serve, profile, demo)."""
    add_capacity_flags(p)
    p.add_argument("--device", default=None, help="auto, cpu or cuda (auto: a GPU if torch sees one)")
    p.add_argument("--load-format", default=None,
                   help="auto (safetensors, else pytorch_model.bin), safetensors, pt (PyTorch .bin state dicts) or "
                        "dummy (random weights)")
    p.add_argument("--seed", type=_seed, default=None, help="seed of the engine's random numbers (0 to 2**64 - 1)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV blocks of a shared prompt prefix")
    p.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")
    p.add_argument("--max-logprobs", type=int_flag, default=None,
                   help="the most top log probabilities (logprobs, prompt_logprobs) a request may ask for per token; "
                        "-1: the whole vocabulary (default: 20, vLLM's)")
    p.add_argument("--disable-cascade-attn", action="store_true", default=None,
                   help="decode steps read a prompt prefix that every running request shares (prefix caching) "
                        "once per request, not once for all (cascade attention; default: cascade where it pays)")
    p.add_argument("--num-scheduler-steps", type=int_flag, default=None,
                   help="decode steps per scheduling round, tokens kept on the device between them "
                        "(default: 8 on CUDA with one rank, else 1; kvfit serve: 1, so an arriving request never "
                        "waits for a round)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and launch the next decode round before reading the tokens of the one on "
                        "the device, so the device does not wait while the host applies them (default: on "
                        "with one rank; tensor parallelism runs without)")
    p.add_argument("--generation-config", default=None,
                   help="default sampling params (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens) "
                        "of requests that leave them out: auto (the model folder's generation_config.json), vllm "
                        "(vLLM's own defaults) or a folder holding a generation_config.json, whose max_new_tokens "
                        "then also caps every request's max_tokens (default: auto)")
    p.add_argument("--plan-json", default=None, help="write the KV plan as JSON to this path (default: not written)")
    add_vllm_engine_flags(p)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The config settings given on the command line (None = not given, keep the default)."""
    from kvfit.config import setting_names
    return {name: getattr(args, name) for name in setting_names()
            if name != "model" and getattr(args, name, None) is not None}
