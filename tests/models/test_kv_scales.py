"""fp8 KV cache scales (models/kv_scales.py): read from a checkpoint's kv_cache_scheme tensors or calculated from
the first batch (--calculate-kv-scales), applied to every attention path; a model whose keys and values pass
fp8's range (448) is wrong with scale 1.0 and close to the 16-bit cache with scales."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvfit import LLM, SamplingParams
from kvfit.errors import ConfigError
from kvfit.models.kv_scales import KVScales, kv_scale_targets
from tiny_models import make_loud_model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))      # fp8_checkpoints (tests/models)

PROMPTS = ["The quick brown fox jumps over", "Hello world! How are you today"]
LOUD = 2000.0      # k and v LOUD times larger, q and o_proj LOUD times smaller: the same model, k and v past 448


@pytest.fixture(scope="module")
def loud_model(tmp_path_factory):
    """Keys and values reach thousands (fp8 e4m3 saturates at 448); outputs equal the plain model's."""
    return make_loud_model(tmp_path_factory.mktemp("kv-scales"), LOUD, num_layers=2)


def _prompt_logprobs(folder: str, **kwargs) -> list[float]:
    """The logprob of every prompt token after the first (attention over the cache it was written to)."""
    llm = LLM(folder, device="cpu", dtype="float32", max_model_len=128, num_gpu_blocks_override=64,
              enable_prefix_caching=False, **kwargs)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0), use_tqdm=False)
    llm.shutdown()
    return [step[t].logprob for out in outs for t, step in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def _with_scales(folder: str, k: float, v: float, names: tuple[str, str]) -> str:
    """folder (an FP8 compressed-tensors checkpoint) with k/v scales under `names` and a kv_cache_scheme, in place."""
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    for layer in {n.split(".self_attn.")[0] for n in tensors if ".self_attn." in n}:
        for name, value in zip(names, (k, v)):
            tensors[f"{layer}.{name}"] = torch.tensor(value)
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                        "dynamic": False, "symmetric": True}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


@pytest.fixture(scope="module")
def reference(loud_model):
    return _prompt_logprobs(loud_model)                        # the 16-bit (fp32) cache: k and v exact


def test_scale_one_breaks_a_loud_model_and_calculated_scales_repair_it(loud_model, reference):
    unscaled = _max_diff(_prompt_logprobs(loud_model, kv_cache_dtype="fp8"), reference)
    calculated = _max_diff(_prompt_logprobs(loud_model, kv_cache_dtype="fp8", calculate_kv_scales=True), reference)
    print(f"\nmax |prompt logprob diff| against the fp32 cache: fp8 scale 1.0 {unscaled:.3f}, "
          f"calculated scales {calculated:.3f}")
    assert calculated < 0.25 < unscaled


@pytest.mark.parametrize("names", [("self_attn.k_scale", "self_attn.v_scale"),
                                   ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
                                   ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale")])     # ModelOpt
def test_checkpoint_scales_are_read_and_used_with_an_fp8_cache(loud_model, tmp_path, names):
    """An FP8 checkpoint (compressed-tensors, per channel) with kv_cache_scheme scales, as llm-compressor writes
    it: an fp8 cache with its scales is close to the same weights over an fp32 cache; scale 1.0 is not."""
    from fp8_checkpoints import write_fp8_copy
    folder, _ = write_fp8_copy(loud_model, tmp_path, "ct-channel")
    exact = _prompt_logprobs(folder)                  # fp32 cache: the scales are read and not needed
    unscaled = _max_diff(_prompt_logprobs(folder, kv_cache_dtype="fp8"), exact)
    _with_scales(folder, 30.0, 30.0, names)           # about amax / 200: k and v stay inside fp8's range
    assert _max_diff(_prompt_logprobs(folder, kv_cache_dtype="float32"), exact) < 1e-5
    scaled = _max_diff(_prompt_logprobs(folder, kv_cache_dtype="fp8"), exact)
    print(f"\nmax |prompt logprob diff| against the fp32 cache: scale 1.0 {unscaled:.3f}, checkpoint's {scaled:.3f}")
    assert scaled < 0.25 < unscaled


def test_checkpoint_scale_names():
    assert kv_scale_targets("model.layers.3.self_attn.k_scale") == [("model.layers.3.self_attn", "k_scale")]
    assert kv_scale_targets("model.layers.3.self_attn.v_proj.output_scale") == [("model.layers.3.self_attn",
                                                                                  "v_scale")]
    assert kv_scale_targets("model.layers.0.self_attn.kv_scale") == [("model.layers.0.self_attn", "k_scale"),
                                                                     ("model.layers.0.self_attn", "v_scale")]
    assert kv_scale_targets("model.layers.0.self_attn.k_proj.weight_scale") == []
    for name in ("k_proj.k_scale", "qkv_proj.k_scale", "attn.k_scale"):       # ModelOpt, fused qkv, an inner attn
        assert kv_scale_targets(f"model.layers.2.self_attn.{name}") == [("model.layers.2.self_attn", "k_scale")]
    assert kv_scale_targets("model.layers.2.self_attn.qkv_proj.v_scale") == [("model.layers.2.self_attn", "v_scale")]


def test_a_scale_per_kv_head_is_split_over_ranks_and_bad_scales_are_refused():
    second_rank = KVScales(total_kv_heads=4, first_kv_head=2, num_kv_heads=2, num_q_heads=4, device="cpu")
    second_rank.load("k_scale", "x.k_scale", torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert second_rank.k_scale.tolist() == [3.0, 4.0] and second_rank.applies
    q = torch.ones(1, 4, 2)
    assert second_rank.scale_query(q)[0, :, 0].tolist() == [3.0, 3.0, 4.0, 4.0]     # two query heads per KV head
    with pytest.raises(ConfigError, match="one per layer or one per KV head"):
        second_rank.load("v_scale", "x.v_scale", torch.ones(3))
    with pytest.raises(ConfigError, match="not a positive number"):
        second_rank.load("v_scale", "x.v_scale", torch.tensor(0.0))
    unit = KVScales(total_kv_heads=2, first_kv_head=0, num_kv_heads=2, num_q_heads=2, device="cpu")
    unit.load("k_scale", "x.k_scale", torch.tensor(1.0))
    assert not unit.applies                     # 1.0 everywhere: the unscaled paths stay


@pytest.mark.parametrize("method, shared", [("fp8", True), ("modelopt", True), ("compressed-tensors", False)])
def test_a_layer_with_one_of_its_kv_scales_is_completed_as_vllm_does(method, shared, caplog):
    """k_scale without v_scale: vLLM's fp8 and ModelOpt KV cache methods use it for both, compressed-tensors keeps
    v at 1.0; said either way (it was silent, and v stayed 1.0 for every method)."""
    import types

    from kvfit.models.loader import _one_sided_kv_scales
    model = torch.nn.ModuleList(KVScales(total_kv_heads=2, first_kv_head=0, num_kv_heads=2, num_q_heads=4,
                                         device="cpu") for _ in range(3))
    model[0].load("k_scale", "a.k_scale", torch.tensor(30.0))
    model[1].load("k_scale", "b.k_scale", torch.tensor([5.0, 6.0]))
    model[2].load("k_scale", "c.k_scale", torch.tensor(2.0))
    model[2].load("v_scale", "c.v_scale", torch.tensor(3.0))
    facts = types.SimpleNamespace(raw={"quantization_config": {"quant_method": method}})
    with caplog.at_level("WARNING", logger="kvfit"):
        _one_sided_kv_scales(model, facts)
    assert model[0].k_scale.tolist() == [30.0, 30.0]
    assert model[0].v_scale.tolist() == ([30.0, 30.0] if shared else [1.0, 1.0])
    assert model[1].v_scale.tolist() == ([5.0, 6.0] if shared else [1.0, 1.0])
    assert model[2].k_scale.tolist() == [2.0, 2.0] and model[2].v_scale.tolist() == [3.0, 3.0]
    assert "2 attention layer(s) have a" in caplog.text
    v_only = torch.nn.ModuleList([KVScales(total_kv_heads=2, first_kv_head=0, num_kv_heads=2, num_q_heads=4,
                                           device="cpu")])
    v_only[0].load("v_scale", "d.v_scale", torch.tensor(4.0))
    if shared:          # vLLM's fp8 KV cache method asserts a k scale
        with pytest.raises(ConfigError, match="v_scale without its k_scale"):
            _one_sided_kv_scales(v_only, facts)
    else:
        _one_sided_kv_scales(v_only, facts)
        assert v_only[0].k_scale.tolist() == [1.0, 1.0]


def test_calculate_kv_scales_needs_an_fp8_cache(loud_model):
    with pytest.raises(ConfigError, match="--calculate-kv-scales .* --kv-cache-dtype fp8"):
        LLM(loud_model, device="cpu", calculate_kv_scales=True)


def test_a_kv_cache_scheme_without_scale_tensors_is_said(loud_model, tmp_path, caplog):
    """config.json declares kv_cache_scheme but no tensor carries a scale: the log says scale 1.0 and the fix,
    not that scales were read."""
    import logging

    from fp8_checkpoints import write_fp8_copy
    folder, _ = write_fp8_copy(loud_model, tmp_path, "ct-channel")
    _with_scales(folder, 30.0, 30.0, ())                        # the scheme only
    with caplog.at_level(logging.INFO, logger="kvfit"):
        LLM(folder, device="cpu", kv_cache_dtype="fp8").shutdown()
    assert "holds no k/v scale tensors" in caplog.text and "--calculate-kv-scales" in caplog.text
    assert "read from the checkpoint" not in caplog.text
    caplog.clear()
    _with_scales(folder, 30.0, 30.0, ("self_attn.k_scale", "self_attn.v_scale"))
    with caplog.at_level(logging.INFO, logger="kvfit"):
        LLM(folder, device="cpu", kv_cache_dtype="fp8").shutdown()
    assert "KV cache scales of 2 of 2 attention layers read from the checkpoint" in caplog.text


KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def _kv_only_copy(source: str, folder, groups) -> str:
    """source (16-bit weights) with k/v scales and a compressed-tensors config that quantizes the KV cache alone,
    as llm-compressor writes it (no config groups, or a group that targets nothing)."""
    import shutil
    shutil.copytree(source, folder)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    for layer in {n.split(".self_attn.")[0] for n in tensors if ".self_attn." in n}:
        tensors[f"{layer}.self_attn.k_scale"] = torch.tensor(30.0)
        tensors[f"{layer}.self_attn.v_scale"] = torch.tensor(30.0)
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "dense", "config_groups": groups,
                                     "ignore": [], "kv_cache_scheme": KV_SCHEME, "quantization_status": "frozen"}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return str(folder)


@pytest.mark.parametrize("groups", [{}, {"group_0": {"targets": []}}])
def test_a_kv_cache_only_checkpoint_loads_16_bit_weights_and_its_scales(loud_model, reference, tmp_path, groups):
    """compressed-tensors' KV-cache-only export: the weights are the 16-bit ones (outputs equal over a 16-bit
    cache), and an fp8 cache uses the checkpoint's scales (close to the fp32 cache; scale 1.0 is not). --kv-cache-dtype
    auto is that fp8 cache, as vLLM 0.26 resolves it for a kv_cache_scheme; a 16-bit cache named is kept."""
    folder = _kv_only_copy(loud_model, tmp_path / "kv-only", groups)
    from kvfit.kv.spec import KVSpec
    from kvfit.model_facts import load_model_facts
    facts = load_model_facts(folder)
    assert facts.quantization is None and facts.kv_cache_scales and facts.fp8_kv_cache_by_default
    assert KVSpec.from_model(facts).dtype == "fp8_e4m3"
    assert KVSpec.from_model(facts, kv_cache_dtype="bfloat16").dtype == "bfloat16"
    assert not load_model_facts(loud_model).fp8_kv_cache_by_default
    assert _max_diff(_prompt_logprobs(folder, kv_cache_dtype="float32"), reference) < 1e-5
    unscaled = _max_diff(_prompt_logprobs(loud_model, kv_cache_dtype="fp8"), reference)
    scaled = _max_diff(_prompt_logprobs(folder, kv_cache_dtype="fp8"), reference)
    assert scaled < 0.25 < unscaled
    assert _max_diff(_prompt_logprobs(folder), reference) == scaled          # auto: the same fp8 cache


@pytest.mark.parametrize("scheme, message", [
    (dict(KV_SCHEME, type="int"), "8-bit 'int' KV cache quantization is not supported"),
    (dict(KV_SCHEME, num_bits=4), "4-bit 'float' KV cache quantization is not supported"),
    (dict(KV_SCHEME, dynamic=True), "static symmetric k/v scales"),
    (dict(KV_SCHEME, strategy="channel"), "static symmetric k/v scales"),
    ("fp8", "kv_cache_scheme must be a JSON object")])
def test_a_kv_cache_scheme_kvfit_cannot_honour_is_refused(scheme, message):
    from kvfit.quant_scheme import declares_kv_cache_scales, parse_quantization_config
    quant = {"quant_method": "compressed-tensors", "config_groups": {}, "kv_cache_scheme": scheme}
    with pytest.raises(ConfigError, match=message) as error:
        declares_kv_cache_scales(quant)
    assert "\n" not in str(error.value)
    assert parse_quantization_config(quant) is None          # the weights: 16-bit either way
    assert declares_kv_cache_scales(dict(quant, kv_cache_scheme=None)) is False


def test_a_compressed_tensors_config_that_quantizes_nothing_is_refused():
    from kvfit.quant_scheme import parse_quantization_config
    for groups in ({}, {"group_0": {"targets": []}}):
        with pytest.raises(ConfigError, match="quantizes nothing"):
            parse_quantization_config({"quant_method": "compressed-tensors", "config_groups": groups})


def test_dense_format_is_read_only_for_a_kv_cache_only_config():
    from kvfit.quant_scheme import parse_quantization_config
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
             "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}
    with pytest.raises(ConfigError, match="format 'dense' stores its quantized weights decompressed"):
        parse_quantization_config({"quant_method": "compressed-tensors", "format": "dense",
                                   "config_groups": {"group_0": group}})
    assert parse_quantization_config({"quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
                                      "kv_cache_scheme": KV_SCHEME}) is None


@pytest.mark.parametrize("quant, fp8", [
    ({"quant_method": "compressed-tensors", "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, True),
    ({"quant_method": "compressed-tensors"}, False),
    ({"quant_method": "modelopt", "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}, True),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}, True),       # flat, a name
    ({"quant_method": "modelopt", "quant_algo": "FP8",
      "kv_cache_scheme": {"num_bits": 8, "type": "float", "dynamic": False}}, True),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, False),
    ({"quant_method": "modelopt", "quantization": {"quant_algo": "FP8"}}, False),
    ({"quant_method": "fp8", "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, False)])
def test_auto_kv_cache_dtype_is_fp8_where_vllm_resolves_it_so(quant, fp8):
    """vLLM 0.26's resolve_kv_cache_dtype_string (ModelOpt: nested or flat, a scheme needs dynamic false) and its
    attention layer (a compressed-tensors kv_cache_scheme); quant_method fp8 has no KV scheme there."""
    from kvfit.quant_scheme import fp8_kv_cache_by_default
    assert fp8_kv_cache_by_default(quant) is fp8
