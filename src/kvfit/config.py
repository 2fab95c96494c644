"""Frozen, validated configuration. Derived values (the KV plan) live in returned objects, not here."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, fields

from kvfit.errors import ConfigError
from kvfit.hub import resolve_model_name
from kvfit.kv.spec import KV_CACHE_DTYPES, check_block_size, resolve_kv_cache_dtype
from kvfit.model_facts import DTYPE_ALIASES
from kvfit.platforms.registry import check_device
from kvfit.quant_scheme import QUANTIZATION_METHODS
from kvfit.units import parse_bytes

# torch.manual_seed takes seeds up to 2**64 - 1; per-request seeds are taken mod 2**64 (sampling_state.py)
MAX_SEED = 2**64 - 1
LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy")
GENERATION_CONFIG_SOURCES = ("auto", "vllm")     # or a folder path
# --max-model-len auto (vLLM's auto / -1): the longest request the KV cache holds, capped by the model's
AUTO_MAX_MODEL_LEN = "auto"
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"--{name.replace('_', '-')} must be true or false, got {value!r}")


def _check_int(name: str, value, minimum: int = 1, allow_none: bool = False):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    model: str                           # resolved at construction: a folder, a config.json's folder, a catalog name
    dtype: str = "auto"                  # auto = the checkpoint's torch_dtype
    # None = the model's max_position_embeddings; "auto" = the longest request the KV cache holds, capped by it
    max_model_len: int | str | None = None
    load_format: str = "auto"
    seed: int = 0
    served_model_name: str | None = None
    revision: str | None = None          # branch, tag or commit of a Hugging Face id (default main)
    # vLLM's --generation-config: where default sampling params come from: auto (the model folder's
    # generation_config.json), vllm (vLLM's own defaults) or a folder holding a generation_config.json
    generation_config: str = "auto"
    # vLLM's --max-logprobs: the most top log probabilities (logprobs, prompt_logprobs) a request may ask for
    # per token; -1: the whole vocabulary. The profile samples with this many, so it costs no unplanned memory.
    max_logprobs: int = 20
    # vLLM's --quantization: fp8 quantizes a 16-bit checkpoint's linear weights to FP8 at load (per output
    # channel, activations per token); None: the checkpoint's own (an FP8 checkpoint's quantization_config)
    quantization: str | None = None

    def __post_init__(self):
        if isinstance(self.model, os.PathLike):
            object.__setattr__(self, "model", os.fspath(self.model))
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("a model is required: a Hugging Face folder or id, a config.json or a catalog name")
        if self.revision is not None and (not isinstance(self.revision, str) or not self.revision):
            raise ConfigError(f"--revision must be a branch, tag or commit hash, got {self.revision!r}")
        # a Hugging Face id becomes its folder in the local cache (offline); a missing folder fails here,
        # before anything reads it
        object.__setattr__(self, "model", resolve_model_name(self.model, self.revision))
        if os.path.basename(self.model) == "config.json" and os.path.isfile(self.model):
            # a config.json names its folder: weights and tokenizer live beside it
            object.__setattr__(self, "model", os.path.dirname(os.path.abspath(self.model)))
        gen = self.generation_config
        if not isinstance(gen, str) or not (gen in GENERATION_CONFIG_SOURCES or os.path.isdir(gen)):
            raise ConfigError(f"--generation-config must be auto, vllm or a folder holding a generation_config.json, "
                              f"got {str(gen)[:200]!r}")
        if self.dtype != "auto" and str(self.dtype).lower() not in DTYPE_ALIASES:
            raise ConfigError(f"--dtype {self.dtype!r} is not supported; use auto, float32, bfloat16 or float16")
        if self.max_model_len == -1 or (isinstance(self.max_model_len, str)
                                         and self.max_model_len.strip().lower() == AUTO_MAX_MODEL_LEN):
            object.__setattr__(self, "max_model_len", AUTO_MAX_MODEL_LEN)
        elif isinstance(self.max_model_len, str):
            raise ConfigError(f"--max-model-len must be an integer >= 1 or auto, got {self.max_model_len!r}")
        else:
            _check_int("max_model_len", self.max_model_len, allow_none=True)
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"--load-format {self.load_format!r} is not supported; use one of {', '.join(LOAD_FORMATS)}")
        _check_int("seed", self.seed, minimum=0)
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ConfigError(f"--max-logprobs must be an integer >= 0, or -1 for the whole vocabulary, "
                              f"got {self.max_logprobs!r}")
        if self.seed > MAX_SEED:
            raise ConfigError(f"--seed must be at most 2**64 - 1 (torch.manual_seed's range), got {self.seed}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ConfigError(f"--quantization {self.quantization!r} is not supported; use "
                              f"{', '.join(QUANTIZATION_METHODS)} (or leave it out: the checkpoint's own)")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # a share of GPU memory; on the CPU only the default is accepted (platforms/cpu.py: --kv-cache-memory sizes it)
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    kv_cache_dtype: str = "auto"
    num_gpu_blocks_override: int | None = None
    max_num_blocks: int | None = None
    kv_cache_memory: int | None = None   # bytes; replaces the utilization-based budget
    enable_prefix_caching: bool = True
    plan_json: str | None = None         # where to write the KV plan as JSON
    calculate_kv_scales: bool = False    # fp8 KV cache: scales from the first batch (models/kv_scales.py)

    def __post_init__(self):
        check_block_size(self.block_size)
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {util!r}")
        if str(self.kv_cache_dtype).lower() not in KV_CACHE_DTYPES:
            resolve_kv_cache_dtype(self.kv_cache_dtype, "bfloat16")  # raises the one-line error
        _check_int("num_gpu_blocks_override", self.num_gpu_blocks_override, allow_none=True)
        _check_int("max_num_blocks", self.max_num_blocks, allow_none=True)
        _check_bool("enable_prefix_caching", self.enable_prefix_caching)
        _check_bool("calculate_kv_scales", self.calculate_kv_scales)
        if self.calculate_kv_scales and not str(self.kv_cache_dtype).lower().startswith("fp8"):
            raise ConfigError("--calculate-kv-scales sets the scales of an fp8 KV cache; add --kv-cache-dtype fp8 "
                              f"(--kv-cache-dtype {self.kv_cache_dtype}: a 16-bit cache, which holds k and v exactly, or "
                              "for a checkpoint that declares an fp8 cache, one with the checkpoint's scales)")
        if self.kv_cache_memory is not None:
            object.__setattr__(self, "kv_cache_memory", parse_bytes(self.kv_cache_memory, "--kv-cache-memory"))


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    # None: the platform's default (Platform.default_max_num_batched_tokens: 8,192 on CUDA, fewer on the CPU),
    # filled in by start-up (Platform.resolve_config) before anything reads it
    max_num_batched_tokens: int | None = None
    # decode steps run back to back on the device per scheduling round (tokens stay on the device
    # between them); None = auto: 8 on CUDA with one rank, else 1
    num_scheduler_steps: int | None = None
    # vLLM's --async-scheduling: the next decode round is launched before the current one's tokens are
    # read; None = auto: on with one rank
    async_scheduling: bool | None = None

    def __post_init__(self):
        _check_int("max_num_seqs", self.max_num_seqs)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, allow_none=True)
        _check_int("num_scheduler_steps", self.num_scheduler_steps, allow_none=True)
        if self.async_scheduling is not None:
            _check_bool("async_scheduling", self.async_scheduling)


# stages at which test_rank_fail can make a rank fail
RANK_FAIL_STAGES = ("start", "load", "step")
DEFAULT_TP_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    # seconds any tensor-parallel rank waits for another at start-up and in the model's collectives;
    # None: KVFIT_TP_TIMEOUT_S if set, else 600 (the environment is read here, once)
    tp_timeout_s: float | None = None
    # tests only, plain data sent to the ranks: {rank: bytes} caps that rank's available KV bytes
    # (as another process on its GPU would); {rank: stage} makes rank >= 1 fail at start, load or step
    test_rank_kv_bytes: dict | None = None
    test_rank_fail: dict | None = None

    def __post_init__(self):
        _check_int("tensor_parallel_size", self.tensor_parallel_size)
        if self.tp_timeout_s is None:
            object.__setattr__(self, "tp_timeout_s", _env_timeout())
        timeout = self.tp_timeout_s
        if (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout)
                or not timeout > 0):
            raise ConfigError(f"tp_timeout_s must be a positive number of seconds, got {timeout!r}")
        for name in ("test_rank_kv_bytes", "test_rank_fail"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), dict):
                raise ConfigError(f"{name} must be a dict {{rank: value}}, got {getattr(self, name)!r}")
        world = self.tensor_parallel_size
        for rank, cap in (self.test_rank_kv_bytes or {}).items():
            if not _is_rank(rank, 0, world) or isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
                raise ConfigError(f"test_rank_kv_bytes: {rank}: {cap!r} is not allowed; use {{RANK: BYTES}} with "
                                  f"RANK in [0, {world})")
        for rank, stage in (self.test_rank_fail or {}).items():
            if not _is_rank(rank, 1, world) or stage not in RANK_FAIL_STAGES:
                raise ConfigError(f"test_rank_fail: {rank}: {stage!r} is not allowed; use {{RANK: STAGE}} with "
                                  f"RANK in [1, {world}) and STAGE one of {', '.join(RANK_FAIL_STAGES)}")


def _is_rank(rank, lowest: int, world: int) -> bool:
    return isinstance(rank, int) and not isinstance(rank, bool) and lowest <= rank < world


def _env_timeout() -> float:
    text = os.environ.get("KVFIT_TP_TIMEOUT_S")
    if text is None:
        return DEFAULT_TP_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"KVFIT_TP_TIMEOUT_S={text!r} must be a positive number of seconds")
    return value


PDL_ENV = "KVFIT_PDL"


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "auto"
    attention_backend: str | None = None   # None = the platform's default
    enforce_eager: bool = False            # no CUDA graphs
    # vLLM's --disable-cascade-attn: decode steps never attend a prefix all sequences share once for all
    disable_cascade_attn: bool = False
    # the Triton kernels launch with programmatic dependent launch where the GPU has it (sm90+: kernels/pdl.py);
    # False: never (A/B measurements, a driver that misbehaves with it). No flag (vLLM has none); LLM(pdl=...).
    # None: KVFIT_PDL (1 or 0) if set, else on (the environment is read here, once)
    pdl: bool | None = None

    def __post_init__(self):
        _check_bool("enforce_eager", self.enforce_eager)
        _check_bool("disable_cascade_attn", self.disable_cascade_attn)
        check_device(self.device)              # the names platforms/registry.py holds
        if self.pdl is None:
            object.__setattr__(self, "pdl", _env_pdl())
        if not isinstance(self.pdl, bool):
            raise ConfigError(f"pdl must be True, False or None ({PDL_ENV}, else on), got {self.pdl!r}")


def _env_pdl() -> bool:
    text = os.environ.get(PDL_ENV, "1").strip()
    if text not in ("0", "1"):
        raise ConfigError(f"{PDL_ENV}={text!r} is not allowed; set it to 1 (launch kernels with programmatic "
                          "dependent launch, the default on sm90+) or 0 (without)")
    return text == "1"


_SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
             "parallel": ParallelConfig, "device": DeviceConfig}


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: DeviceConfig

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        """Build from flat keyword arguments (CLI flags or LLM(...)); unknown names are rejected."""
        sections: dict[str, dict] = {name: {} for name in _SECTIONS}
        owner = {f.name: name for name, klass in _SECTIONS.items() for f in fields(klass)}
        for key, value in kwargs.items():
            if key not in owner:
                known = ", ".join(sorted(k for k in owner if k != "model"))
                raise ConfigError(f"unknown setting {key!r}; known settings: {known}")
            sections[owner[key]][key] = value
        sections["model"]["model"] = model
        return cls(**{name: _SECTIONS[name](**values) for name, values in sections.items()})

    def replace(self, **kwargs) -> "EngineConfig":
        flat = {f.name: getattr(getattr(self, s), f.name) for s, k in _SECTIONS.items() for f in fields(k)}
        flat.update(kwargs)
        return EngineConfig.from_kwargs(flat.pop("model"), **flat)


def setting_names() -> list[str]:
    return [f.name for klass in _SECTIONS.values() for f in dataclasses.fields(klass)]


def setting_default(name: str):
    """The default of config setting `name` (None where it has none, or where None means "derived")."""
    for klass in _SECTIONS.values():
        for f in dataclasses.fields(klass):
            if f.name == name:
                return None if f.default is dataclasses.MISSING else f.default
    return None
