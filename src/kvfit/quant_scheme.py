"""Which 8-bit weight scheme a model runs with, read from config.json's quantization_config (no torch).

kvfit runs FP8 (float8_e4m3fn) weights in the two layouts the Hub writes, and quantizes 16-bit weights
to FP8 at load (`--quantization fp8`):
- compressed-tensors (`quant_method: "compressed-tensors"`, `format: "float-quantized"`): one config group of
  8-bit float weights per tensor (`weight_scale` [1] or []), per channel (`weight_scale` [N, 1]) or per
  [128, 128] block (`strategy: "block"`, `weight_scale` [ceil(N/128), ceil(K/128)]); activations dynamic per
  token (or per token and 128-column group with block weights) or static per tensor (`input_scale`); an
  `ignore` list of module names and `re:` patterns left in 16 bits. A `transform_config` whose rotations are all
  fused into the weights (`weight_input` / `weight_output`) needs nothing at run time; one applied to activations
  at run time (QuIP's `input`, SpinQuant's R3/R4) is refused.
- `quant_method: "fp8"` (transformers' FineGrainedFP8Config, DeepSeek-V3, Qwen3-*-FP8; `fmt` "e4m3" or
  "float8_e4m3fn"): `weight_block_size`
  [128, 128] with `weight_scale_inv` [ceil(N/128), ceil(K/128)] (a multiplier, despite the name) and dynamic
  activations per token and 128-column group; without a block size, per-tensor `weight_scale` (and
  `input_scale` when `activation_scheme` is static). `modules_to_not_convert` / `ignored_layers` stay in 16 bits.
- online (`--quantization fp8` on a 16-bit checkpoint): per output channel (vLLM's online fp8 is per tensor;
  per channel loses less and costs one fp32 per row), activations dynamic per token.
Activations quantized dynamically are quantized per token in every scheme without blocks (vLLM's "fp8" method,
and compressed-tensors' dynamic `strategy: tensor`, quantize them per tensor; per token is what the per-channel
GEMM takes and is at least as accurate).
- ModelOpt (`quant_method: "modelopt"` in config.json, or hf_quant_config.json's `quantization` as NVIDIA's older
  exports write it): `quant_algo` FP8 (per-tensor `weight_scale` and static `input_scale`) or
  FP8_PER_CHANNEL_PER_TOKEN (`weight_scale` [N], dynamic per token); `exclude_modules` / `ignore` are wildcards
  (fnmatch, as ModelOpt writes them); `kv_cache_quant_algo` FP8 means k/v scales in the checkpoint. NVFP4, MXFP8
  and the block weight-only FP8_PB_WO are refused.
A compressed-tensors config that quantizes only the KV cache (`kv_cache_scheme` without weight groups) leaves the
weights 16-bit and its k/v scales are read (models/kv_scales.py); a kv_cache_scheme kvfit cannot honour (integer,
dynamic, per channel) is refused, as vLLM refuses it.
Anything else (int4/int8, AWQ, GPTQ, e5m2, weight-only FP8, mixed groups) is a one-line ConfigError naming it:
a checkpoint kvfit cannot run correctly is never loaded as if it were 16-bit.
"""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass

from kvfit.errors import ConfigError

DUMMY_INPUT_SCALE = 1.0 / 64     # dummy weights with static FP8 activations: |x| up to 7 before clipping
QUANTIZATION_METHODS = ("fp8", "compressed-tensors", "modelopt", "fbgemm_fp8")   # --quantization (vLLM's names)
ONLINE_METHODS = ("fp8",)                    # of those, what quantizes a 16-bit checkpoint at load
MODELOPT_ALGOS = {"FP8": ("tensor", "static"),                  # ModelOpt quant_algo -> (weights, activations)
                  "FP8_PER_CHANNEL_PER_TOKEN": ("channel", "token")}
MODELOPT_FILE = "hf_quant_config.json"       # where older ModelOpt exports declare their quantization
WEIGHT_STRATEGIES = ("tensor", "channel", "block")
ACTIVATION_MODES = ("token", "group", "static")
SCALE_NAMES = ("weight_scale", "weight_scale_inv")
E4M3_NAMES = ("e4m3", "float8_e4m3fn")       # the fp8 method's `fmt` (MiniMax-M2 writes the torch dtype's name)
KV_SCALE_STRATEGIES = ("tensor", "attn_head")   # kv_cache_scheme: a k/v scale per layer, or per KV head
FUSED_TRANSFORMS = ("weight_input", "weight_output")   # compressed-tensors transforms applied offline, into weights
FP8_MAX = 448.0                              # largest finite float8_e4m3fn
MIN_AMAX = 1e-10                             # an all-zero row still gets a finite scale (its values quantize to 0)
# scratch of one quantized GEMM per element of its input, which the capacity estimate counts: dynamic
# activations on CUDA are quantized in one Triton launch into the fp8 result alone; static ones (and the
# torch path elsewhere) make an fp32 copy first, divided in place (kernels/fp8.py)
ACTIVATION_SCRATCH_BYTES = 1
STATIC_ACTIVATION_SCRATCH_BYTES = 4 + 1


# a fused module's leaf -> the projections it stacks by rows, in order (vLLM's packed_modules_mapping; Phi-3's
# checkpoints hold the fused tensors), and each projection's fused module
PACKED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
FUSED_MODULES = {part: fused for fused, parts in PACKED_MODULES.items() for part in parts}


def _names(module: str, name: str) -> bool:
    """An ignore list's plain name names module: the module itself, a suffix of whole parts, or a module it is in."""
    return module == name or module.endswith("." + name) or module.startswith(name + ".")


def _matches(module: str, entry: str, plain) -> bool:
    """An ignore or targets entry names module: a pattern after "re:" matched at its start (compressed-tensors'
    rule), else plain(module, entry)."""
    return bool(re.match(entry[3:], module)) if entry.startswith("re:") else plain(module, entry)


@dataclass(frozen=True)
class Fp8Scheme:
    """How one model's linear weights (and activations) are held in 8 bits."""

    method: str                              # "compressed-tensors", "fp8" (checkpoint) or "fp8" online
    weight_strategy: str                     # tensor | channel | block
    activation: str                          # token (dynamic per token) | group (per token and block column) |
    #                                          static (the checkpoint's per-tensor input_scale)
    block_size: tuple[int, int] | None = None     # (rows N, columns K) per weight scale, block strategy only
    scale_name: str = "weight_scale"         # the checkpoint's name of the weight scale tensor
    ignore: tuple[str, ...] = ()             # module names or "re:" patterns kept in the model dtype
    online: bool = False                     # quantized at load from a 16-bit checkpoint
    ue8m0_scales: bool = False               # scale_fmt "ue8m0": weight scales are powers of two; stored as uint8
    #                                          they are float8_e8m0fnu's exponent bytes (DeepSeek-V3.1's exports)
    mxfp4_experts: bool = False              # quant_method fp8's store_dtype "mxfp4": vLLM runs the routed experts
    #                                          in MXFP4 (kvfit refuses such experts; dense layers stay FP8)
    activation_ub: float | None = None       # fbgemm_fp8's activation_scale_ub: a token's amax is capped at it
    #                                          before its scale (values past it saturate at +-448)
    targets: tuple[str, ...] = ()            # compressed-tensors' layer targets (names, "re:" patterns); (): every
    #                                          linear layer ("Linear")

    def __post_init__(self):
        assert self.weight_strategy in WEIGHT_STRATEGIES and self.activation in ACTIVATION_MODES, self
        assert (self.block_size is not None) == (self.weight_strategy == "block"), self
        assert self.activation != "group" or self.weight_strategy == "block", self
        assert self.activation_ub is None or (self.activation == "token" and self.weight_strategy == "channel"), self

    def quantizes(self, module: str) -> bool:
        """Whether module (a checkpoint name such as model.layers.0.self_attn.q_proj) is in FP8. An ignore list may
        name the fused module vLLM builds from it (self_attn.qkv_proj, mlp.gate_up_proj: vLLM's is_layer_skipped
        and should_ignore_layer honour that name, not a pattern over it): its parts stay 16-bit too."""
        prefix, _, leaf = module.rpartition(".")
        fused = FUSED_MODULES.get(leaf)
        fused_name = None if fused is None else f"{prefix}.{fused}"
        if self.targets and not any(_matches(name, target, str.__eq__) for name in (module, fused_name) if name
                                    for target in self.targets):
            return False                                   # no group targets it (vLLM's find_matched_target)
        if fused is not None and any(_names(fused_name, p) for p in self.ignore if not p.startswith("re:")):
            return False
        return not any(_matches(module, pattern, _names) for pattern in self.ignore)

    def describe(self) -> str:
        """e.g. 'fp8 (compressed-tensors, per channel, activations per token)' for logs and the capacity line."""
        weights = (f"{self.block_size[0]}x{self.block_size[1]} blocks" if self.block_size
                   else f"per {self.weight_strategy}")
        acts = {"token": "per token", "group": f"per token and {self.block_size and self.block_size[1]} columns",
                "static": "static per tensor"}[self.activation]
        if self.activation_ub is not None:
            acts += f" (amax capped at {self.activation_ub:g})"
        source = "online" if self.online else self.method
        return f"fp8 ({source}, weights {weights}, activations {acts})"


ONLINE_FP8 = Fp8Scheme(method="fp8", weight_strategy="channel", activation="token", online=True)


def parse_quantization_config(quant: dict, source: str = "config.json", key: str = "quantization_config"
                              ) -> Fp8Scheme | None:
    """config.json's quantization_config (or the key it was read from) -> the Fp8Scheme kvfit runs; None when
    there is none, or when it quantizes only the KV cache (compressed-tensors' kv_cache_scheme without weight
    groups: 16-bit weights, k/v scales in the checkpoint). Anything kvfit cannot run is a one-line ConfigError
    naming the key, the method and what is supported."""
    if not quant:
        return None
    where = f"{source} {key}"
    method = quant.get("quant_method")
    if not isinstance(method, str):
        raise ConfigError(f"{where}: 'quant_method' must be a string (e.g. \"fp8\"), got {_show(method)}")
    if method.lower() == "compressed-tensors":        # some exports write "FP8"
        return _compressed_tensors(quant, where)
    if method.lower() == "fp8":
        return _fp8_method(quant, where)
    if method.lower() == "modelopt":
        return _modelopt(quant, where)
    if method.lower() == "fbgemm_fp8":
        return _fbgemm_fp8(quant, where)
    raise ConfigError(f"{where}: quant_method {_show(method)} is not supported; kvfit runs FP8 checkpoints "
                      "(compressed-tensors float8, fp8, fbgemm_fp8 or ModelOpt FP8) and --quantization fp8 on 16-bit "
                      "ones")


def resolve_scheme(checkpoint: Fp8Scheme | None, quantization: str | None, source: str = "config.json",
                   kv_cache_only: str | None = None) -> Fp8Scheme | None:
    """The scheme to run: the checkpoint's, or --quantization fp8 on a 16-bit checkpoint (online); a
    --quantization that contradicts the checkpoint's method is a ConfigError (as vLLM). kv_cache_only: the
    quant_method of a config that quantizes only the KV cache (checkpoint None: 16-bit weights)."""
    if quantization is None:
        return checkpoint
    if quantization not in QUANTIZATION_METHODS:
        raise ConfigError(f"--quantization {quantization!r} is not supported; use one of "
                          f"{', '.join(QUANTIZATION_METHODS)} (or leave it out)")
    if checkpoint is None and kv_cache_only is not None:     # its method names it; fp8 contradicts it, as in vLLM
        if quantization != kv_cache_only:
            raise ConfigError(f"--quantization {quantization} does not match the checkpoint's quant_method "
                              f"{kv_cache_only!r} ({source}; it quantizes only the KV cache, the weights are "
                              "16-bit); leave --quantization out to use the checkpoint's")
        return None
    if checkpoint is None:
        if quantization not in ONLINE_METHODS:
            raise ConfigError(f"--quantization {quantization} reads a {quantization} checkpoint, and {source} declares "
                              "none; use --quantization fp8 to quantize 16-bit weights at load")
        return ONLINE_FP8
    if checkpoint.method != quantization:
        raise ConfigError(f"--quantization {quantization} does not match the checkpoint's quant_method "
                          f"{checkpoint.method!r} ({source}); leave --quantization out to use the checkpoint's")
    return checkpoint


def declares_kv_cache_scales(quant: dict, source: str = "config.json", key: str = "quantization_config") -> bool:
    """Whether the quantization_config's kv_cache_scheme says the checkpoint carries fp8 k/v cache scales; a
    scheme kvfit cannot honour (integer, dynamic, per channel or per token) is a one-line ConfigError, as vLLM
    refuses it."""
    where = f"{source} {key}".rstrip()
    nested = (quant or {}).get("quantization")
    if str((quant or {}).get("quant_method", "")).lower() == "modelopt" and isinstance(nested, dict):
        algo = nested.get("kv_cache_quant_algo")           # hf_quant_config.json's form: a name, FP8 or none
        if algo is not None and str(algo).upper() != "FP8":
            raise ConfigError(f"{where}: ModelOpt kv_cache_quant_algo {_show(algo)} is not supported; kvfit "
                              "runs an fp8 KV cache (FP8), or leave it out")
        return algo is not None
    scheme = (quant or {}).get("kv_cache_scheme")
    if not scheme:
        return False
    where = f"{where} kv_cache_scheme"
    if not isinstance(scheme, dict):
        raise ConfigError(f"{where} must be a JSON object (num_bits, type, strategy), got {_show(scheme)}")
    if scheme.get("num_bits") != 8 or scheme.get("type") != "float":
        raise ConfigError(f"{where}: {scheme.get('num_bits')}-bit {_show(scheme.get('type'))} KV cache "
                          "quantization is not supported; kvfit runs an fp8 (8-bit float) KV cache with static "
                          "scales")
    if scheme.get("dynamic") or scheme.get("strategy", "tensor") not in KV_SCALE_STRATEGIES \
            or scheme.get("symmetric") is False:
        raise ConfigError(f"{where}: {_show(scheme)} is not supported; kvfit reads static symmetric k/v scales, one "
                          f"per layer or one per KV head (strategy {' or '.join(KV_SCALE_STRATEGIES)})")
    return True


def fp8_kv_cache_by_default(quant: dict) -> bool:
    """Whether --kv-cache-dtype auto means fp8 for this quantization_config, as vLLM 0.26 resolves auto: a
    compressed-tensors kv_cache_scheme (its attention layer); ModelOpt's kv_cache_scheme or kv_cache_quant_algo,
    nested under `quantization` or not, an 8-bit static float scheme or "FP8"
    (utils/torch_utils.get_kv_cache_quant_algo_string)."""
    quant = quant or {}
    method = str(quant.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return quant.get("kv_cache_scheme") is not None
    if not method.startswith("modelopt"):
        return False
    inner = quant.get("quantization") if isinstance(quant.get("quantization"), dict) else quant
    algo = (inner.get("kv_cache_scheme") or quant.get("kv_cache_scheme") or inner.get("kv_cache_quant_algo")
            or quant.get("kv_cache_quant_algo"))
    if isinstance(algo, dict):
        return algo.get("dynamic") is False and algo.get("num_bits") == 8 and algo.get("type") == "float"
    return isinstance(algo, str) and algo.lower() == "fp8"


def kv_cache_only(quant: dict, where: str) -> bool:
    """A compressed-tensors config that quantizes the KV cache alone (llm-compressor writes no config groups, or
    groups that target nothing): the weights are 16-bit. A config that quantizes nothing at all is refused
    (nothing says what its weights are)."""
    groups = quant.get("config_groups")
    if groups is not None and not isinstance(groups, dict):
        return False                             # _compressed_tensors names the error
    if any(not isinstance(group, dict) or group.get("targets", ["Linear"]) != [] for group in (groups or {}).values()):
        return False
    if not quant.get("kv_cache_scheme"):
        raise ConfigError(f"{where}: compressed-tensors with no config_groups and no kv_cache_scheme quantizes "
                          "nothing; remove quantization_config for 16-bit weights, or fix the config")
    return True


def _compressed_tensors(quant: dict, where: str) -> Fp8Scheme | None:
    fmt = quant.get("format")
    if fmt not in ("float-quantized", "naive-quantized", "dense", None):
        raise ConfigError(f"{where}: compressed-tensors format {_show(fmt)} is not supported; kvfit runs "
                          "float-quantized (FP8) compressed-tensors checkpoints")
    sparsity = quant.get("sparsity_config") or {}
    if isinstance(sparsity, dict) and sparsity.get("format") not in (None, "dense"):
        raise ConfigError(f"{where}: compressed-tensors sparsity ({_show(sparsity.get('format'))}) is not "
                          "supported; kvfit runs dense FP8 weights")
    if kv_cache_only(quant, where):
        return None
    if fmt == "dense":                  # weights saved decompressed: 16-bit values and no FP8 weights to read
        raise ConfigError(f"{where}: compressed-tensors format 'dense' stores its quantized weights decompressed, "
                          "which kvfit does not run; save the model compressed (float-quantized)")
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"{where}: compressed-tensors needs 'config_groups' (a JSON object of schemes)")
    schemes, targets = set(), []
    for name, group in groups.items():
        schemes.add(_ct_group(name, group, f"{where} config_groups.{name}"))
        targets += _ct_targets(group.get("targets", ["Linear"]), f"{where} config_groups.{name}")
    if len(schemes) > 1:
        raise ConfigError(f"{where}: config_groups mix {len(schemes)} different schemes; kvfit runs one FP8 "
                          "scheme for every quantized layer")
    strategy, block, activation = schemes.pop()
    _check_transforms(quant.get("transform_config"), where)
    every_linear = any(target.lower() == "linear" for target in targets)
    return Fp8Scheme(method="compressed-tensors", weight_strategy=strategy, activation=activation, block_size=block,
                     ignore=_ignore_list(quant.get("ignore"), "ignore", where),
                     targets=() if every_linear else tuple(dict.fromkeys(targets)))


def _ct_targets(targets, where: str) -> list[str]:
    """A config group's targets: "Linear" (every linear layer), layer names, or "re:" patterns over them (vLLM's
    find_matched_target; a layer no group targets stays 16-bit). Other module classes are a ConfigError."""
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise ConfigError(f"{where}: targets must be a non-empty list of module names, got {_show(targets)}")
    _ignore_list(targets, "targets", where)                 # the patterns compile
    # a name without a dot is a module class (vLLM matches it against the class's name) unless it is lower case
    # (a top-level module's name, e.g. lm_head)
    classes = [t for t in targets if not t.startswith("re:") and "." not in t and t.lower() != "linear"
               and t != t.lower()]
    if classes:
        raise ConfigError(f"{where}: targets {_show(classes)} are not supported; kvfit runs FP8 schemes that target "
                          "Linear layers: by the class \"Linear\", by module name or by \"re:\" pattern")
    return targets


def _check_transforms(transforms, where: str) -> None:
    """compressed-tensors' transform_config: rotations fused into the weights offline are already in them; one
    applied to activations at run time would be missing, so the rotated weights would run on unrotated inputs."""
    if not transforms:
        return
    groups = transforms.get("config_groups") if isinstance(transforms, dict) else None
    if not isinstance(groups, dict):
        raise ConfigError(f"{where}: transform_config must be a JSON object with 'config_groups', got "
                          f"{_show(transforms)}")
    for name, group in groups.items():
        applied = group.get("apply", []) if isinstance(group, dict) else None
        if not isinstance(applied, list) or not all(isinstance(args, dict) for args in applied):
            raise ConfigError(f"{where}: transform_config group {name!r} needs an 'apply' list, got {_show(group)}")
        online = [args.get("location") for args in applied if args.get("location") not in FUSED_TRANSFORMS]
        if online:
            raise ConfigError(f"{where}: transform_config group {name!r} applies a rotation at location "
                              f"{_show(online[0])} at run time, which is not supported; kvfit runs only transforms "
                              f"fused into the weights (locations {', '.join(FUSED_TRANSFORMS)})")


def _ct_group(name: str, group, where: str) -> tuple[str, tuple[int, int] | None, str]:
    if not isinstance(group, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {_show(group)}")
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise ConfigError(f"{where}: a scheme without 'weights' is not supported; kvfit runs FP8 weights")
    bits, kind, strategy = weights.get("num_bits"), weights.get("type"), weights.get("strategy")
    if bits != 8 or kind != "float":
        raise ConfigError(f"{where}: weights of {bits} bits, type {_show(kind)} are not supported; kvfit runs "
                          "8-bit float (FP8) weights only (no int4/int8, AWQ or GPTQ)")
    if weights.get("dynamic") or weights.get("symmetric") is False or weights.get("actorder"):
        raise ConfigError(f"{where}: FP8 weights must be static and symmetric without actorder; got {_show(weights)}")
    block = None
    if strategy == "block":
        block = _block_size(weights.get("block_structure"), f"{where} weights.block_structure")
    elif strategy not in ("tensor", "channel"):
        raise ConfigError(f"{where}: weights strategy {_show(strategy)} is not supported; use tensor, channel "
                          "or block")
    acts = group.get("input_activations")
    if acts is None:
        raise ConfigError(f"{where}: weight-only FP8 (no input_activations) is not supported; kvfit runs FP8 "
                          "weights with FP8 activations (W8A8)")
    if not isinstance(acts, dict) or acts.get("num_bits") != 8 or acts.get("type") != "float":
        raise ConfigError(f"{where}: input_activations must be 8-bit float, got {_show(acts)}")
    act_strategy, dynamic = acts.get("strategy"), bool(acts.get("dynamic"))
    if dynamic and act_strategy in ("token", "tensor", "group"):
        # dynamic activations are quantized as the weights' GEMM reads them, whatever strategy the group names
        # (vLLM's CompressedTensorsW8A8Fp8 does the same): per token and block column with block weights, else per
        # token (finer than per tensor, coarser than a group's columns: what the per-channel GEMM takes)
        activation = "group" if block is not None else "token"
    elif not dynamic and act_strategy == "tensor" and block is None:
        activation = "static"
    else:
        raise ConfigError(f"{where}: input_activations strategy {_show(act_strategy)} (dynamic {dynamic}) with "
                          f"{strategy} weights is not supported; kvfit runs dynamic per-token (per-group with "
                          "block weights) or static per-tensor activations")
    return strategy, block, activation


def _fp8_method(quant: dict, where: str) -> Fp8Scheme:
    fmt = quant.get("fmt", "e4m3")
    if fmt not in E4M3_NAMES:
        raise ConfigError(f"{where}: fp8 fmt {_show(fmt)} is not supported; kvfit runs e4m3 (float8_e4m3fn)")
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ConfigError(f"{where}: activation_scheme {_show(scheme)} is not supported; use dynamic or static")
    # vLLM's Fp8Config reads ignored_layers, and modules_to_not_convert only where that is empty
    key = "ignored_layers" if quant.get("ignored_layers") else "modules_to_not_convert"
    ignore = _ignore_list(quant.get(key), key, where)
    scale_fmt = quant.get("scale_fmt")
    if scale_fmt not in (None, "ue8m0"):
        raise ConfigError(f"{where}: scale_fmt {_show(scale_fmt)} is not supported; kvfit reads float scales "
                          "(no scale_fmt) and \"ue8m0\" (powers of two)")
    ue8m0 = scale_fmt == "ue8m0"
    store = quant.get("store_dtype")
    if store not in (None, "mxfp4"):   # vLLM acts on "mxfp4" alone (its routed experts in MXFP4)
        raise ConfigError(f"{where}: store_dtype {_show(store)} is not supported; kvfit reads fp8 weights stored as "
                          "e4m3: leave store_dtype out")
    mxfp4 = store == "mxfp4"
    block = quant.get("weight_block_size")
    if block is None:
        # AutoFP8 writes weight_scale (+ input_scale); transformers' FineGrainedFP8Config without blocks writes
        # weight_scale_inv (+ activation_scale): both are multipliers, read under the first names
        # (SCALE_ALIASES in models/loader.py)
        activation = "token" if scheme == "dynamic" else "static"
        return Fp8Scheme(method="fp8", weight_strategy="tensor", activation=activation, ignore=ignore,
                         ue8m0_scales=ue8m0, mxfp4_experts=mxfp4)
    block = _block_size(block, f"{where} weight_block_size")
    if scheme != "dynamic":
        raise ConfigError(f"{where}: block-wise fp8 needs activation_scheme dynamic, got {scheme!r}")
    return Fp8Scheme(method="fp8", weight_strategy="block", activation="group", block_size=block,
                     scale_name="weight_scale_inv", ignore=ignore, ue8m0_scales=ue8m0, mxfp4_experts=mxfp4)


def _fbgemm_fp8(quant: dict, where: str) -> Fp8Scheme:
    """FBGEMM's FP8 (Meta's Llama FP8 releases): weights per output channel (`weight_scale` [N, 1]), activations per
    token with each token's amax capped at activation_scale_ub, `modules_to_not_convert` in 16 bits (vLLM's
    FBGEMMFp8Config: linear layers only)."""
    ub = quant.get("activation_scale_ub")
    if isinstance(ub, bool) or not isinstance(ub, (int, float)) or not math.isfinite(ub) or ub <= 0:
        raise ConfigError(f"{where}: fbgemm_fp8 needs activation_scale_ub, a positive number (Meta's releases write "
                          f"1200.0), got {_show(ub)}")
    return Fp8Scheme(method="fbgemm_fp8", weight_strategy="channel", activation="token", activation_ub=float(ub),
                     ignore=_ignore_list(quant.get("modules_to_not_convert"), "modules_to_not_convert", where))


def _modelopt(quant: dict, where: str) -> Fp8Scheme | None:
    """ModelOpt's two spellings: config.json's flat {quant_algo, ignore, kv_cache_scheme} and hf_quant_config.json's
    {quantization: {quant_algo, kv_cache_quant_algo, exclude_modules}}."""
    nested = quant.get("quantization")
    if nested is not None and not isinstance(nested, dict):
        raise ConfigError(f"{where}: ModelOpt 'quantization' must be a JSON object, got {_show(nested)}")
    inner, ignore_key = (nested, "exclude_modules") if nested is not None else (quant, "ignore")
    algo = inner.get("quant_algo")
    if algo is None:
        if declares_kv_cache_scales(quant, where, ""):
            return None                  # the KV cache alone: 16-bit weights, k/v scales read
        raise ConfigError(f"{where}: ModelOpt config without quant_algo quantizes nothing; remove it for 16-bit "
                          "weights, or fix the config")
    strategy = MODELOPT_ALGOS.get(str(algo).upper())
    if strategy is None:
        raise ConfigError(f"{where}: ModelOpt quant_algo {_show(algo)} is not supported; kvfit runs ModelOpt "
                          f"{' and '.join(MODELOPT_ALGOS)} (no NVFP4, MXFP8 or FP8_PB_WO)")
    names = inner.get(ignore_key) or []
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise ConfigError(f"{where}: {ignore_key!r} must be a list of module names, got {_show(names)}")
    ignore = tuple(f"re:{fnmatch.translate(name)}" if any(c in name for c in "*?[") else name for name in names)
    return Fp8Scheme(method="modelopt", weight_strategy=strategy[0], activation=strategy[1],
                     ignore=_ignore_list(list(ignore), ignore_key, where))


def _ignore_list(value, key: str, where: str) -> tuple[str, ...]:
    """Module names and "re:" patterns left in 16 bits; a pattern that does not compile is a ConfigError here,
    not an re.error while the model is built."""
    names = value or []
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise ConfigError(f"{where}: {key!r} must be a list of module names, got {_show(value)}")
    for name in names:
        if name.startswith("re:"):
            try:
                re.compile(name[3:])
            except re.error as exc:
                raise ConfigError(f"{where}: {key} entry {name!r} is not a valid regular expression ({exc}); "
                                  "fix the pattern after 're:'") from None
    return tuple(names)


def _block_size(value, where: str) -> tuple[int, int]:
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 16 and v & (v - 1) == 0
                       for v in value)):
        raise ConfigError(f"{where} must be [rows, columns], powers of two >= 16 (e.g. [128, 128]), got {_show(value)}")
    return value[0], value[1]


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
