"""Build a model (its class found in models/registry.py) and fill its weights: from safetensors (one
file or sharded), from PyTorch's pickled state dicts (pytorch_model.bin, one file or sharded), or at random
("dummy").

--load-format (vLLM's): `auto` reads safetensors where the folder has them, else .bin files; `safetensors` and `pt`
read only those; `dummy` reads nothing. The files of a format are those its index names (model.safetensors.index.json,
pytorch_model.bin.index.json), else the single file (model.safetensors, pytorch_model.bin), else every file of that
kind in the folder (vLLM globs them too), less training state (optimizer.bin, training_args.bin, ...).

With tensor parallelism each rank reads only its slice of each tensor (safetensors' lazy get_slice), so no rank
ever holds a whole sharded tensor, let alone the whole model. A .bin file in torch.save's zip format (PyTorch 1.6
and later) is memory-mapped (torch.load(mmap=True); weights_only: no code in the pickle runs), so a rank's copy is
still only its slice, read from the page cache; an older .bin cannot be mapped and each rank reads all of it.

kvfit reads quantization from config.json's quantization_config (or, where that is absent, older
compressed-tensors' `compression_config`, as vLLM). A checkpoint that fails to load while its quantization is
declared elsewhere (AutoGPTQ's quantize_config.json, AutoAWQ's quant_config.json, ModelOpt's hf_quant_config.json)
says so, not which tensor was missing; beside 16-bit weights such a file is ignored, as vLLM and transformers do.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Iterator

import torch

from kvfit.attention.base import AttentionBackend
from kvfit.errors import CapacityError, ConfigError
from kvfit.model_facts import ModelFacts, read_field, read_json_object
from kvfit.models.kv_scales import kv_scale_layers
from kvfit.models.quant.experts import Fp8Experts
from kvfit.models.quant.linear import Fp8Linear
from kvfit.models.registry import model_class
from kvfit.quant_scheme import DUMMY_INPUT_SCALE
from kvfit.units import gib

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PT_SINGLE_FILE = "pytorch_model.bin"
PT_INDEX_FILE = "pytorch_model.bin.index.json"
# files of a checkpoint folder that hold training state, not weights (vLLM leaves the same out)
NOT_WEIGHTS = frozenset({"training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt",
                         "rng_state.pth"})
DUMMY_SEED = 0
logger = logging.getLogger("kvfit")
DUMMY_STD = 0.02
QUANTIZATION_FILES = ("quantize_config.json", "quant_config.json", "hf_quant_config.json")


def _one_sided_kv_scales(model: torch.nn.Module, facts: ModelFacts) -> None:
    """Layers whose checkpoint has a k scale and no v scale (or the reverse): as vLLM 0.26, the fp8 and ModelOpt
    methods give a k scale to v too and refuse a v scale alone (its assert); compressed-tensors keeps the other
    at 1.0. Said either way."""
    layers = [layer for layer in kv_scale_layers(model) if len(layer.read) == 1]
    if not layers:
        return
    quant = facts.raw.get("quantization_config") or facts.raw.get("compression_config") or {}
    shared = str(quant.get("quant_method", "")).lower() != "compressed-tensors"
    if shared and any(layer.read == {"v_scale"} for layer in layers):
        raise ConfigError("the checkpoint has a KV cache v_scale without its k_scale in "
                          f"{sum(layer.read == {'v_scale'} for layer in layers)} attention layer(s); vLLM refuses it "
                          "too (its fp8 KV cache method needs the k scale): add the k scales, or remove the v scales")
    for layer in layers if shared else ():
        layer.share_the_one_read()
    which = sorted(layers[0].read)[0]
    other = "v_scale" if which == "k_scale" else "k_scale"
    logger.warning("%d attention layer(s) have a %s and no %s in the checkpoint: an fp8 KV cache %s", len(layers),
                   which, other, f"uses the {which} for both (as vLLM's fp8 and ModelOpt methods)" if shared else
                   f"keeps {other} 1.0 (as vLLM's compressed-tensors); the checkpoint may be incomplete")


def load_model(model_path: str, facts: ModelFacts, dtype: torch.dtype, device, attention_backend: AttentionBackend,
               load_format: str = "auto", tp_rank: int = 0, tp_size: int = 1) -> torch.nn.Module:
    """facts.architecture's model on `device`, weights from model_path ("auto"/"safetensors"/"pt") or random
    ("dummy"); an architecture that can only be planned is a ConfigError."""
    cls = model_class(facts.architecture)
    files = None if load_format == "dummy" else checkpoint_files(model_path, load_format)
    try:
        model = cls(facts, dtype, device, attention_backend, tp_rank=tp_rank, tp_size=tp_size)
        if files is None:
            init_dummy_weights(model)
        else:
            _load_checkpoint(model, files, model_path, facts)
        finalize_quantized(model)
        if facts.quantization is not None:
            logger.info("weights: %s", facts.quantization.describe())
        if files is not None:
            _one_sided_kv_scales(model, facts)
        if facts.kv_cache_scales and files is not None:
            layers = kv_scale_layers(model)
            loaded = sum(layer.loaded for layer in layers)
            if loaded:
                logger.info("KV cache scales of %d of %d attention layers read from the checkpoint "
                            "(kv_cache_scheme): an fp8 KV cache uses them (--kv-cache-dtype auto takes one for %s, "
                            "as vLLM), a 16-bit one does not need them", loaded, len(layers),
                            "this checkpoint" if facts.fp8_kv_cache_by_default else "compressed-tensors and ModelOpt")
            else:
                logger.warning("the quantization config declares fp8 KV cache scales (kv_cache_scheme, or ModelOpt's "
                               "kv_cache_quant_algo) but the checkpoint holds no k/v scale tensors: an fp8 KV cache "
                               "would use scale 1.0 (add --calculate-kv-scales)")
    except (RuntimeError, MemoryError, TypeError) as exc:   # torch.OutOfMemoryError is a RuntimeError; a size
        # past int64 is a TypeError from torch.empty
        if not _is_allocation_failure(exc):
            raise
        per_param = torch.tensor([], dtype=dtype).element_size()
        total = facts.weight_bytes if facts.quantization is not None else facts.num_params * per_param
        raise CapacityError(
            f"the weights do not fit: allocating them on {device} failed (about {gib(total // tp_size)} per rank for "
            f"{facts.num_params:,} parameters); use a larger device, --tensor-parallel-size, a smaller --dtype or "
            "--quantization fp8") from None
    return model.eval()


def finalize_quantized(model: torch.nn.Module) -> None:
    """Call after the weights are in (checkpoint or dummy): every Fp8Linear builds the weight its GEMM reads, and
    static FP8 experts take their layer's input scales."""
    for module in model.modules():
        if isinstance(module, (Fp8Linear, Fp8Experts)):
            module.finalize()


# per-tensor fp8 (quant_method "fp8" without weight_block_size) as transformers' FineGrainedFP8Config writes it
# (Mistral's FP8 releases): its scale names -> AutoFP8's, which the layers take. Both are multipliers.
SCALE_ALIASES = ((".weight_scale_inv", ".weight_scale"), (".activation_scale", ".input_scale"))


def scale_aliases(tensors: Iterator[tuple[str, object]], scheme, renamed: set | None = None
                  ) -> Iterator[tuple[str, object]]:
    """The checkpoint's tensors, with a per-tensor fp8 checkpoint's scale names read as the layers name them; the
    (suffix, alias) pairs it applied are added to `renamed`."""
    if scheme is None or scheme.online or scheme.method != "fp8" or scheme.weight_strategy != "tensor":
        yield from tensors
        return
    for name, tensor in tensors:
        for suffix, alias in SCALE_ALIASES:
            if name.endswith(suffix):
                name = name[:-len(suffix)] + alias
                if renamed is not None:
                    renamed.add((suffix, alias))
                break
        yield name, tensor


def _load_checkpoint(model: torch.nn.Module, files: list[str], model_path: str, facts: ModelFacts) -> None:
    renamed: set[tuple[str, str]] = set()
    try:
        model.load_weights(scale_aliases(_iter_tensors(files), facts.quantization, renamed))
    except ConfigError as exc:
        if renamed:         # name the scales as the checkpoint does (weight_scale_inv, not its alias weight_scale)
            message = str(exc)
            for suffix, alias in renamed:
                message = re.sub(rf"{re.escape(alias)}\b", suffix, message)
            raise ConfigError(message) from None
        declared = None
        if facts.quantization is None or facts.quantization.online:
            declared = quantization_declared_elsewhere(model_path, facts.raw)
        if declared is None:
            raise
        raise ConfigError(declared) from None


def quantization_declared_elsewhere(model_path: str, config: dict) -> str | None:
    """The one-line reason a checkpoint is quantized where kvfit does not read it (a quantization file beside
    config.json); None when nothing declares quantized weights."""
    for name in QUANTIZATION_FILES:
        path = os.path.join(model_path, name)
        if not os.path.isfile(path):
            continue
        try:
            declared = read_json_object(path)
        except ConfigError:
            declared = {}
        modelopt = declared.get("quantization")
        if isinstance(modelopt, dict):
            if modelopt.get("quant_algo") is None:
                continue                    # a KV-cache-only ModelOpt export: its weights are 16-bit
            what = f"modelopt {modelopt['quant_algo']}"
        elif declared.get("quant_method"):
            what = f"quant_method {declared['quant_method']!r}"
        else:
            bits = declared.get("bits", declared.get("w_bit"))
            what = f"{bits}-bit" if bits else "an unknown method"
        return (f"{path} declares quantized weights ({what}), which kvfit does not run; kvfit runs FP8 checkpoints "
                "declared in config.json's quantization_config (compressed-tensors float8, or fp8) and "
                "--quantization fp8 on 16-bit ones")
    return None


# what torch says when a tensor cannot be had: CUDA and CPU allocators, and sizes past int64
_ALLOCATION_FAILURES = ("out of memory", "can't allocate memory", "overflow", "negative dimension")


def _is_allocation_failure(exc: BaseException) -> bool:
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    message = str(exc).lower()
    return any(words in message for words in _ALLOCATION_FAILURES)


def checkpoint_files(model_path: str, load_format: str = "auto") -> list[str]:
    """The checkpoint's weight files for --load-format auto, safetensors or pt (the module docstring's order)."""
    if load_format not in ("auto", "safetensors", "pt"):
        raise ConfigError(f"--load-format {load_format!r} is not supported; use auto, safetensors, pt or dummy")
    if load_format in ("auto", "safetensors"):
        files = _format_files(model_path, INDEX_FILE, SINGLE_FILE, (".safetensors",))
        if files or load_format == "safetensors":
            return files or _no_weights(model_path, f"{SINGLE_FILE}, {INDEX_FILE} or other *.safetensors files")
    files = _format_files(model_path, PT_INDEX_FILE, PT_SINGLE_FILE, (".bin", ".pt"))
    if files:
        return files
    what = (f"{PT_SINGLE_FILE}, {PT_INDEX_FILE} or other *.bin / *.pt files" if load_format == "pt" else
            f"{SINGLE_FILE} or {PT_SINGLE_FILE} (or an index of either, or other *.safetensors / *.bin files)")
    return _no_weights(model_path, what)


def _no_weights(model_path: str, what: str) -> list[str]:
    raise ConfigError(f"no {what} in {model_path}: kvfit found no weights to load; use --load-format dummy to run "
                      "with random weights")


def _format_files(model_path: str, index_name: str, single_name: str, suffixes: tuple[str, ...]) -> list[str]:
    """One format's files: those its index names, else its single file, else every file with its suffix
    (sorted; training state left out); [] where the folder has none."""
    index = os.path.join(model_path, index_name)
    if os.path.isfile(index):
        weight_map = read_field(read_json_object(index), "weight_map", "object", index, required=True)
        for tensor, shard in weight_map.items():
            if not isinstance(shard, str) or not shard or os.path.basename(shard) != shard:
                raise ConfigError(f"{index}: 'weight_map' must map tensor names to shard file names in the model "
                                  f"folder, got {tensor!r}: {shard!r}; fix or re-download it")
        files = [os.path.join(model_path, name) for name in dict.fromkeys(weight_map.values())]
        for path in files:
            if not os.path.isfile(path):
                raise ConfigError(f"{index_name} names shard {os.path.basename(path)} but it is not in {model_path}; "
                                  "re-download the model")
        return files
    single = os.path.join(model_path, single_name)
    if os.path.isfile(single):
        return [single]
    if not os.path.isdir(model_path):
        return []
    return [os.path.join(model_path, name) for name in sorted(os.listdir(model_path))
            if name.endswith(suffixes) and name not in NOT_WEIGHTS and os.path.isfile(os.path.join(model_path, name))]


def _iter_tensors(files: list[str]) -> Iterator[tuple[str, object]]:
    """(name, tensor) over every file, with a progress bar over tensors (stderr, tty only): a lazy safetensors
    slice (it reads nothing until indexed, and is valid only until the next item: its file closes), or a tensor of
    a memory-mapped .bin state dict (counted into the bar when its file opens)."""
    from safetensors import safe_open
    from tqdm import tqdm
    total = 0
    for path in files:
        if path.endswith(".safetensors"):
            try:
                with safe_open(path, framework="pt", device="cpu") as fh:
                    total += len(fh.keys())
            except Exception as exc:   # safetensors raises its own error types for a bad header
                raise ConfigError(f"{path} is not a readable safetensors file ({exc}); re-download it") from None
    with tqdm(total=total, desc="loading weights", unit="tensor", leave=False, disable=None) as bar:
        for path in files:
            if path.endswith(".safetensors"):
                with safe_open(path, framework="pt", device="cpu") as fh:
                    for name in fh.keys():
                        yield name, fh.get_slice(name)
                        bar.update(1)
                continue
            state = _load_state_dict(path)
            bar.total += len(state)
            for name in list(state):
                yield name, state.pop(name)
                bar.update(1)


def _load_state_dict(path: str) -> dict[str, torch.Tensor]:
    """A .bin/.pt file's state dict, memory-mapped where its format allows (the zip format torch.save writes since
    1.6), read with weights_only: a pickle that holds anything but tensors and plain containers is refused, never run."""
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)        # the legacy (pre-zip) format
    except Exception as exc:
        first_line = str(exc).splitlines()[0][:200] if str(exc) else ""
        raise ConfigError(f"{path} is not a readable PyTorch state dict of tensors ({type(exc).__name__}: "
                          f"{first_line}); re-download it, or convert it to safetensors") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise ConfigError(f"{path} is not a state dict of named tensors; re-download it, or convert it to "
                          "safetensors")
    return state


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int = DUMMY_SEED, std: float = DUMMY_STD) -> None:
    """Random weights for profiling and benchmarks: normal(0, std), norm weights 1; same seed, same weights.

    Each checkpoint tensor draws from its own generator, seeded by its name (a fused parameter's parts each
    by theirs), so the weights do not depend on iteration order or on which projections are fused. With
    tensor parallelism each rank draws its own parts from the same seeds (never the whole tensor), so dummy
    weights differ between tensor-parallel sizes.
    """
    fp8 = {id(module.weight): module for module in model.modules() if isinstance(module, Fp8Linear)}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        if getattr(param, "quant_scale", False):
            continue            # an FP8 weight's scales: set with its weight
        parts = getattr(param, "parts", None)
        if parts is None:
            gen = _generator(param, seed, name)
            if not (hasattr(model, "init_dummy_special") and model.init_dummy_special(name, param, gen, std)):
                param.normal_(0.0, std, generator=gen)
            continue
        layer = fp8.get(id(param))
        for index, part in enumerate(parts):
            gen = _generator(param, seed, part.name)
            if layer is None:
                param[part.rows].normal_(0.0, std, generator=gen)
                continue
            # FP8: drawn in fp32, quantized as the layer's scheme says
            drawn = torch.empty(param[part.rows].shape, dtype=torch.float32, device=param.device)
            layer.set_part(index, drawn.normal_(0.0, std, generator=gen))
        if layer is not None and layer.input_scale is not None:
            layer.input_scale.fill_(DUMMY_INPUT_SCALE)


def _generator(param: torch.nn.Parameter, seed: int, name: str) -> torch.Generator:
    return torch.Generator(device=param.device).manual_seed(seed + _stable_hash(name))


def _stable_hash(name: str) -> int:
    return sum((i + 1) * ord(c) for i, c in enumerate(name)) % (2**31)
