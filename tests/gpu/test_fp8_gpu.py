"""FP8 on the GPU (issue 28): the CUDA GEMMs against the fp32 reference, tiny FP8 checkpoints greedy against
the CPU path (logprob differences printed), and --quantization fp8 on llama-3.1-8b (dummy weights): FP8 weights
in memory and `kvfit plan` within 2% of the profile; a block-wise FP8 Qwen3-30B-A3B shape (dummy) runs with CUDA
graphs through the fused FP8 experts. tests/kernels/test_fp8_gemm.py runs its kernel tests on the GPU too.
Run: python -m pytest tests/gpu/test_fp8_gpu.py -q -s
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("triton")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models"))

from kvfit.kernels.fp8 import (Fp8Weight, fp8_linear_reference, quantize_weight_blocks,  # noqa: E402
                               quantize_weight_per_channel)
from kvfit.kernels.fp8_block_gemm import block_fp8_linear  # noqa: E402
from kvfit.kernels.fp8_gemm import fp8_linear, scaled_mm_applies  # noqa: E402


def _generates_in_full(llm, max_tokens: int) -> None:
    """Four greedy requests each get all max_tokens tokens."""
    from kvfit import SamplingParams
    out = llm.generate([[10, 11, 12, 13]] * 4, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                       use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in out)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


@pytest.mark.parametrize("n,k", [(4096, 4096), (1024, 4096), (14336, 4096)])
def test_one_token_reads_the_fp8_weight_through_the_gemv(n, k):
    """Batch-1 decode: the FP8 GEMV with the activation unquantized, equal to the dequantized product."""
    torch.manual_seed(0)
    wq, ws = quantize_weight_per_channel(torch.randn(n, k, device="cuda") * 0.02)
    w = Fp8Weight(wq, ws, None)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    got, want = fp8_linear(x, w, bias), x.float() @ w.dequantize().t() + bias.float()
    print(f"fp8 gemv n={n} k={k}: relative error {_rel_err(got, want):.2e}")
    assert got.dtype == torch.bfloat16 and _rel_err(got, want) < 1e-2    # one bf16 rounding of the output


@pytest.mark.parametrize("m", [2, 7, 256])
@pytest.mark.parametrize("n,k", [(4096, 4096), (1024, 4096), (14336, 4096)])
def test_scaled_mm_matches_the_reference(m, n, k):
    torch.manual_seed(0)
    wq, ws = quantize_weight_per_channel(torch.randn(n, k, device="cuda") * 0.02)
    w = Fp8Weight(wq, ws, None)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    assert scaled_mm_applies(x, w)
    got, want = fp8_linear(x, w, bias), fp8_linear_reference(x, w, bias)
    assert got.dtype == torch.bfloat16
    print(f"scaled_mm m={m} n={n} k={k}: relative error {_rel_err(got, want):.2e}")
    assert _rel_err(got, want) < 1e-2          # one bf16 rounding of the output, fp32 sums in another order


@pytest.mark.parametrize("m", [1, 33, 512])
@pytest.mark.parametrize("n,k", [(4096, 4096), (1536, 2048), (2048, 768), (300, 200)])
def test_block_gemm_matches_the_reference(m, n, k):
    torch.manual_seed(1)
    wq, ws = quantize_weight_blocks(torch.randn(n, k, device="cuda") * 0.02, (128, 128))
    w = Fp8Weight(wq, ws, (128, 128))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    got, want = block_fp8_linear(x, w), fp8_linear_reference(x, w)
    print(f"block gemm m={m} n={n} k={k}: relative error {_rel_err(got, want):.2e}")
    assert _rel_err(got, want) < 1e-2


@pytest.mark.parametrize("arch,fmt,block", [("llama", "ct-channel", (128, 128)), ("qwen3", "block", (128, 128)),
                                            ("qwen3", "ct-static", (128, 128)), ("qwen3_moe", "block", (32, 32))])
def test_tiny_fp8_checkpoint_greedy_equals_the_cpu_path(tmp_path, arch, fmt, block):
    from fp8_checkpoints import write_fp8_copy
    from tiny_models import make_tiny_model

    from kvfit import LLM, SamplingParams
    folder, _ = write_fp8_copy(make_tiny_model(tmp_path, arch=arch), tmp_path, fmt, block=block)
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=5, ignore_eos=True)
    prompts = ["The quick brown fox", "Hello world! How are you"]
    runs, gpu = {}, None
    for device in ("cpu", "cuda"):
        llm = LLM(folder, dtype="bfloat16", device=device, kv_cache_memory="64MiB", max_model_len=256)
        runs[device] = llm.generate(prompts, params, use_tqdm=False)
        if device == "cuda":
            gpu = llm
        else:
            llm.shutdown()
    _check_greedy_near_ties(runs["cpu"], runs["cuda"], gpu, f"{arch} {fmt}",
                            expert_flips=2 if arch == "qwen3_moe" else 0)
    gpu.shutdown()


def _check_greedy_near_ties(cpu_runs, gpu_runs, gpu_llm, label: str, expert_flips: int = 0) -> None:
    """The CPU's greedy tokens equal the GPU's, with logprobs within bf16's rounding over a few layers; where the
    two part (a tiny random model's next-token distribution is nearly flat: its top tokens lie a few hundredths
    apart), the CPU's token must be a near-tie on the GPU: the GPU's own logprob of it (its prompt logprob after
    the shared tokens) within 0.2 of the GPU's pick.

    A MoE may part further (expert_flips > 0): a random router's expert scores lie a few hundredths apart too, and
    rounding that flips one expert choice moves that token's logits by far more than the rounding. That is a
    discrete event, not a drift: the GPU then scores the CPU's whole sequence (teacher-forced prompt logprobs) and
    at most expert_flips positions of it may differ from the CPU's logprobs by more than 0.2, none by more than 2."""
    from kvfit import SamplingParams
    for cpu, gpu in zip(cpu_runs, gpu_runs):
        a, b = cpu.outputs[0], gpu.outputs[0]
        same = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        diffs = [abs(pa[t].logprob - pb[t].logprob) for pa, pb, t in zip(a.logprobs, b.logprobs, a.token_ids[:same])]
        print(f"{label}: {same} of {len(a.token_ids)} greedy tokens equal; max |logprob diff| {max(diffs, default=0):.3e}")
        assert not diffs or max(diffs) < 0.2
        if same == len(a.token_ids):
            continue
        # the GPU scores the CPU's whole sequence once (prompt logprobs are causal: position i sees tokens < i)
        ids = list(cpu.prompt_token_ids) + list(a.token_ids)
        scored = gpu_llm.generate([{"prompt_token_ids": ids}],
                                  SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0), use_tqdm=False)
        forced = scored[0].prompt_logprobs[-len(a.token_ids):]          # forced[i]: the GPU's at the CPU's token i
        cpu_token = a.token_ids[same]
        gap = b.logprobs[same][b.token_ids[same]].logprob - forced[same][cpu_token].logprob
        print(f"{label}: parted at token {same}: the GPU's logprob of the CPU's token is {gap:.3f} under its pick")
        if gap < 0.2:
            continue
        assert expert_flips, (same, cpu_token, gap)
        teacher = [abs(f[t].logprob - p[t].logprob) for f, p, t in zip(forced, a.logprobs, a.token_ids)]
        far = [i for i, d in enumerate(teacher) if d > 0.2]
        print(f"{label}: the CPU's sequence scored on the GPU: |logprob diff| over 0.2 at positions {far} "
              f"(max {max(teacher):.3f})")
        assert len(far) <= expert_flips and max(teacher) < 2.0, (far, teacher)


def test_llama_8b_online_fp8_holds_fp8_weights_and_plans_within_2_percent():
    from gpu_capacity import estimated_blocks

    from kvfit import LLM
    from kvfit.model_facts import load_model_facts
    model = "llama-3.1-8b"
    settings = dict(load_format="dummy", dtype="bfloat16", device="cuda", quantization="fp8", max_model_len=8192,
                    gpu_memory_utilization=0.5, max_num_seqs=64, max_num_batched_tokens=8192)
    llm = LLM(model, **settings)
    try:
        facts = load_model_facts(model, "fp8")
        reading = llm.engine.readings[0]
        print(f"\nweights measured {reading.weights_bytes} vs facts {facts.weight_bytes}; "
              f"plan {llm.capacity.log_line()}")
        assert abs(reading.weights_bytes - facts.weight_bytes) <= 0.02 * facts.weight_bytes
        predicted = estimated_blocks(model, settings, llm)
        assert abs(predicted - llm.capacity.num_blocks) <= 0.02 * llm.capacity.num_blocks
        _generates_in_full(llm, 32)
    finally:
        llm.shutdown()


def test_qwen3_30b_a3b_blockwise_fp8_runs(tmp_path):
    """The aim's shape: Qwen3-30B-A3B with [128, 128] FP8 blocks (dummy weights) on one GPU, experts in the
    fused FP8 kernels, CUDA graphs on; `kvfit plan` within 2% of the profile; prints the FP8 plan."""
    from kvfit import LLM
    from kvfit.catalog import model_config
    folder = tmp_path / "qwen3-30b-a3b-fp8"
    folder.mkdir()
    config = dict(model_config("qwen3-30b-a3b"), quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
    (folder / "config.json").write_text(json.dumps(config))
    settings = dict(load_format="dummy", dtype="bfloat16", device="cuda", max_model_len=8192,
                    gpu_memory_utilization=0.85, max_num_seqs=32, max_num_batched_tokens=4096,
                    enable_prefix_caching=False)
    llm = LLM(str(folder), **settings)
    try:
        print(f"\nFP8 plan: {llm.capacity.log_line()}")
        from gpu_capacity import estimated_blocks
        predicted = estimated_blocks(str(folder), settings, llm)
        assert abs(predicted - llm.capacity.num_blocks) <= 0.02 * llm.capacity.num_blocks
        _generates_in_full(llm, 16)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch,fmt,block", [("llama", "ct-channel", (128, 128)), ("qwen3", "block", (32, 32)),
                                            ("qwen3_moe", "block", (32, 32))])
@pytest.mark.parametrize("eager", [True, False])
def test_norm_quantizing_for_the_gemm_changes_no_number(tmp_path, monkeypatch, arch, fmt, block, eager):
    """The RMSNorm and SiLU kernels that quantize their output for the FP8 qkv, gate_up, experts or down GEMM
    (PreQuantized) give the same logprobs, bit for bit, as those kernels followed by the separate quantize."""
    from fp8_checkpoints import write_fp8_copy
    from tiny_models import make_tiny_model

    from kvfit import LLM, SamplingParams
    from kvfit.kernels import fused_ops
    folder, _ = write_fp8_copy(make_tiny_model(tmp_path, arch=arch), tmp_path, fmt, block=block)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True)
    prompts = ["The quick brown fox", "Hello world! How are you", "a b c d e f g"]
    calls = []
    norm, silu = fused_ops.add_rms_norm_quant, fused_ops.silu_mul_quant
    monkeypatch.setattr(fused_ops, "add_rms_norm_quant", lambda *a: calls.append("norm") or norm(*a))
    monkeypatch.setattr(fused_ops, "silu_mul_quant", lambda *a: calls.append("silu") or silu(*a))
    runs = []
    for fuse in (True, False):
        if not fuse:
            monkeypatch.setattr(fused_ops, "norm_quant_applies", lambda cols, group: False)
            monkeypatch.setattr(fused_ops, "silu_quant_applies", lambda cols, group: False)
        llm = LLM(folder, dtype="bfloat16", device="cuda", kv_cache_memory="64MiB", max_model_len=256,
                  enforce_eager=eager)      # not eager: decode steps replay CUDA graphs captured with the fusion
        runs.append(llm.generate(prompts, params, use_tqdm=False))
        llm.shutdown()
        if fuse:
            assert "norm" in calls and (arch == "qwen3_moe" or "silu" in calls), calls
            count = len(calls)
    assert len(calls) == count                               # the second run used the separate quantize
    for a, b in zip(*runs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [{t: p.logprob for t, p in d.items()} for d in a.outputs[0].logprobs] == \
               [{t: p.logprob for t, p in d.items()} for d in b.outputs[0].logprobs]


@pytest.mark.parametrize("m", [1024, 2055])
@pytest.mark.parametrize("n,k", [(5120, 2048), (2048, 4096), (256, 512)])
def test_block_weights_from_many_rows_take_cublas_blockwise_scaling(m, n, k):
    """From BLOCK_SCALED_MM_MIN_ROWS rows a [128, 128]-block weight runs cuBLASLt's blockwise-scaled _scaled_mm:
    the reference's numbers up to fp32 sum order and one bf16 rounding, with a bias, and the same output from
    an input quantized ahead (PreQuantized)."""
    from kvfit.kernels.fp8 import PreQuantized, quantize_activations
    from kvfit.kernels.fp8_gemm import BLOCK_SCALED_MM_MIN_ROWS, block_scaled_mm_applies
    torch.manual_seed(2)
    wq, ws = quantize_weight_blocks(torch.randn(n, k, device="cuda") * 0.02, (128, 128))
    w = Fp8Weight(wq, ws, (128, 128))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    if not block_scaled_mm_applies(x, w):
        pytest.skip(f"torch {torch.__version__}'s _scaled_mm takes no block scales on this GPU")
    assert not block_scaled_mm_applies(x[:BLOCK_SCALED_MM_MIN_ROWS - 1], w)
    got, want = fp8_linear(x, w, bias), fp8_linear_reference(x, w, bias)
    print(f"cuBLAS blockwise m={m} n={n} k={k}: relative error {_rel_err(got, want):.2e}")
    assert got.dtype == torch.bfloat16 and _rel_err(got, want) < 1e-2
    assert torch.equal(fp8_linear(PreQuantized(x, *quantize_activations(x, w), 128), w, bias), got)
    # K / 128 not a multiple of 4 (cuBLASLt would read the weight's scales with a padded stride): the Triton GEMM
    wq3, ws3 = quantize_weight_blocks(torch.randn(n, 384, device="cuda") * 0.02, (128, 128))
    w3, x3 = Fp8Weight(wq3, ws3, (128, 128)), x[:, :384].contiguous()
    assert not block_scaled_mm_applies(x3, w3)
    assert _rel_err(fp8_linear(x3, w3), fp8_linear_reference(x3, w3)) < 1e-2


@pytest.mark.parametrize("eager", [True, False])
def test_tuned_channel_gemm_in_the_engine_matches_scaled_mm(tmp_path, monkeypatch, eager):
    """A tuned-config file naming every linear of a tiny per-channel FP8 llama on this device (split-K on down) puts
    the Triton channel GEMM in the engine, CUDA graphs included; its tokens are _scaled_mm's, but for near-ties, and
    its logprobs within the two GEMMs' rounding."""
    from fp8_checkpoints import write_fp8_copy
    from tiny_models import make_tiny_model

    from kvfit import LLM, SamplingParams
    from kvfit.kernels import fp8_channel_configs as cc
    from kvfit.kernels import fp8_gemm
    folder, _ = write_fp8_copy(make_tiny_model(tmp_path, arch="llama"), tmp_path, "ct-channel")
    # the tiny llama: hidden 64, 4 heads of 16 (2 kv), intermediate 128: qkv [128, 64], o [64, 64], gate_up [256, 64],
    # down [64, 128]
    shapes = {"128x64": [16, 64, 4, 2, 1, 64], "64x64": [16, 32, 4, 2, 1, 32], "256x64": [32, 64, 4, 2, 1, 64],
              "64x128": [16, 64, 4, 2, 2, 64]}
    tuned = tmp_path / "tuned.json"
    tuned.write_text(json.dumps({torch.cuda.get_device_name(): {s: [[512, c]] for s, c in shapes.items()}}))
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
    prompts = ["The quick brown fox", "Hello world! How are you", "a b c d e f g"]
    paths, runs, llms = [], {}, {}
    path_of = fp8_gemm.fp8_path
    monkeypatch.setattr(fp8_gemm, "fp8_path", lambda x, w: paths.append(path_of(x, w)) or paths[-1])
    for name, source in (("scaled_mm", "off"), ("tuned", str(tuned))):
        monkeypatch.setattr(cc, "CONFIG_PATH", source)
        llms[name] = LLM(folder, dtype="bfloat16", device="cuda", kv_cache_memory="64MiB", max_model_len=256,
                         enforce_eager=eager)
        runs[name] = llms[name].generate(prompts, params, use_tqdm=False)
        if name == "tuned":
            assert fp8_gemm.CHANNEL_GEMM in paths, sorted(set(paths))
        else:
            assert fp8_gemm.CHANNEL_GEMM not in paths and fp8_gemm.SCALED_MM in paths, sorted(set(paths))
            paths.clear()
    try:
        _check_greedy_near_ties(runs["scaled_mm"], runs["tuned"], llms["tuned"], f"channel gemm eager={eager}")
    finally:
        for llm in llms.values():
            llm.shutdown()
