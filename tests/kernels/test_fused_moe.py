"""Mixture-of-experts: routing and the torch reference against transformers' MoE blocks, the fused Triton
path against the reference (Triton's interpreter on CPU, the real kernels on a GPU), the kernels compiled
for sm_90 without a GPU, and offsets past 2^31 in the interpreter."""

from __future__ import annotations

import importlib
import itertools
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

COMPILE_CHECK = __name__ == "__main__" and sys.argv[1:] == ["--compile-check"]
if not torch.cuda.is_available() and not COMPILE_CHECK:
    os.environ.setdefault("TRITON_INTERPRET", "1")     # before the kernels' module is (re)imported
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

from kvfit.kernels import fused_moe as fm  # noqa: E402
from kvfit.kernels import moe_align as ma  # noqa: E402


def _interpreter_fixes() -> None:
    import sys
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))    # also when run as a script
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)
    from triton_interpreter import apply_interpreter_fixes
    apply_interpreter_fixes()


if INTERPRET and fm.triton is not None:
    _interpreter_fixes()
    from triton.runtime.interpreter import InterpretedFunction
    if not isinstance(fm._gate_up_kernel, InterpretedFunction):   # imported before TRITON_INTERPRET was set
        fm = importlib.reload(fm)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = fm.make_config(16, 16, 16, 2, 4, 1)     # the smallest tiles: several blocks per expert in tiny shapes


def moe_naive(x, w13, w2, topk_weights, topk_ids):
    """The definition, one token and one slot at a time, in fp32."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            xt = x[t].float()
            h = F.silu(w13[e, :inter].float() @ xt) * (w13[e, inter:].float() @ xt)
            out[t] += topk_weights[t, j].float() * (w2[e].float() @ h)
    return out


def random_moe(num_tokens, num_experts, hidden, inter, top_k, dtype=torch.float32, seed=0, ids=None):
    """x, w13, w2 and a routing (random logits unless ids are given), on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5
    if ids is None:
        weights, ids = fm.select_experts(torch.randn(num_tokens, num_experts, generator=g), top_k, renormalize=True)
    else:
        weights = torch.rand(ids.shape, generator=g) + 0.1
    return [t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_a_per_token_loop(dtype):
    x, w13, w2, weights, ids = random_moe(9, 6, 24, 20, 3, dtype)
    ids[:, 0] = 5                                 # one expert shared by every token; others by none
    got = fm.moe_reference(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu())
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), moe_naive(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu()),
                               rtol=tol, atol=tol)


def tiny_block(arch: str, norm_topk_prob: bool = True):
    """transformers' sparse MoE block (Qwen3-MoE or Mixtral) with random weights, in fp32."""
    transformers = pytest.importorskip("transformers")
    common = dict(hidden_size=32, num_experts_per_tok=2, hidden_act="silu")
    if arch == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
        config = transformers.Qwen3MoeConfig(num_experts=6, moe_intermediate_size=24,
                                             norm_topk_prob=norm_topk_prob, **common)
        block = Qwen3MoeSparseMoeBlock(config)
    else:
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
        block = MixtralSparseMoeBlock(transformers.MixtralConfig(num_local_experts=6, intermediate_size=24, **common))
    torch.manual_seed(1)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block.eval()


@pytest.mark.parametrize("arch,renormalize", [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True)])
def test_routing_and_reference_match_transformers_block(arch, renormalize):
    block = tiny_block(arch, renormalize)
    x = torch.randn(11, 32, generator=torch.Generator().manual_seed(2))
    logits = F.linear(x, block.gate.weight)
    weights, ids = fm.select_experts(logits, 2, renormalize)
    _, hf_weights, hf_ids = block.gate(x)
    assert torch.equal(ids, hf_ids) and weights.dtype == torch.float32
    torch.testing.assert_close(weights, hf_weights, rtol=0, atol=0)
    with torch.no_grad():
        expected = block(x[None])[0]
        got = fm.moe_reference(x, block.experts.gate_up_proj, block.experts.down_proj, weights, ids)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_select_experts_in_bf16_rounds_as_transformers(arch):
    # routing is fp32 in both (softmax upcasts); Qwen3-MoE then rounds the weights to the model dtype
    block = tiny_block(arch).to(torch.bfloat16)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    weights, ids = fm.select_experts(F.linear(x, block.gate.weight), 2, renormalize=True)
    _, hf_weights, hf_ids = block.gate(x)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights.to(hf_weights.dtype), hf_weights, rtol=0, atol=0)


def test_select_experts_rejects_bad_arguments():
    logits = torch.randn(3, 4)
    with pytest.raises(ValueError, match="top_k=5 must be in"):
        fm.select_experts(logits, 5, True)
    with pytest.raises(ValueError, match="scoring_func='sigmoid' is not supported"):
        fm.select_experts(logits, 2, True, scoring_func="sigmoid")
    with pytest.raises(ValueError, match=r"router_logits must be \[num_tokens, num_experts\]"):
        fm.select_experts(logits[0], 2, True)


def test_moe_align_groups_pairs_by_expert_and_pads_each_group():
    pytest.importorskip("triton")
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])                  # pairs 0..5 -> experts 2 0 2 3 0 2
    sorted_ids, block_experts = ma.moe_align(ids.to(DEVICE), num_experts=5, block_m=4)
    pad = 6
    # expert 0: pairs 1 4; expert 1: none; expert 2: pairs 0 2 5; expert 3: pair 3; then unused blocks
    assert block_experts.tolist()[:3] == [0, 2, 3] and min(block_experts.tolist()[3:]) >= 5
    groups = sorted_ids.view(-1, 4).tolist()                      # order inside a group is the atomics'
    assert [sorted(g) for g in groups[:3]] == [[1, 4, pad, pad], [0, 2, 5, pad], [3, pad, pad, pad]]
    assert all(g == [pad] * 4 for g in groups[3:])
    assert len(sorted_ids) == 4 * len(block_experts) >= ma.max_padded_pairs(6, 5, 4)


def align_reference(flat_ids: torch.Tensor, num_experts: int, block_m: int):
    """The grouping moe_align must give, in torch: each expert's sorted pair ids, its group's first row and
    padded size, and the expert of each block in use."""
    counts = torch.bincount(flat_ids, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    members = [torch.nonzero(flat_ids == e).flatten().tolist() for e in range(num_experts)]
    block_experts = torch.repeat_interleave(torch.arange(num_experts), padded // block_m)
    return members, starts.tolist(), padded.tolist(), block_experts


def assert_aligned(ids: torch.Tensor, num_experts: int, block_m: int, sorted_ids, block_experts) -> None:
    """moe_align's outputs against align_reference: shapes fixed by the input shapes, every group holds
    exactly its expert's pairs then padding (num_pairs), blocks past the last group name an expert >= E."""
    flat = ids.reshape(-1).long()
    num_pairs = flat.numel()
    assert sorted_ids.dtype == block_experts.dtype == torch.int32
    num_blocks = -(-ma.max_padded_pairs(num_pairs, num_experts, block_m) // block_m)
    assert sorted_ids.shape == (num_blocks * block_m,) and block_experts.shape == (num_blocks,)
    sorted_ids, block_experts = sorted_ids.cpu().long(), block_experts.cpu().long()
    members, starts, padded, expected_experts = align_reference(flat, num_experts, block_m)
    used = len(expected_experts)
    assert torch.equal(block_experts[:used], expected_experts)
    assert bool((block_experts[used:] >= num_experts).all())
    for e in range(num_experts):
        group = sorted_ids[starts[e]:starts[e] + padded[e]].tolist()
        assert group == group[:len(members[e])] + [num_pairs] * (padded[e] - len(members[e])), e  # pairs first
        assert sorted(group[:len(members[e])]) == members[e], e
    assert bool((sorted_ids[used * block_m:] == num_pairs).all())


# (T, k, E, block_m, ids): Mixtral's 8 and Qwen2-MoE's 60 experts (not a power of two), 128 and 1000;
# pair counts of no round size; experts nobody picks; every pair on one expert; more programs than pairs
ALIGN_CASES = [
    (1, 1, 8, 16, None),
    (333, 2, 8, 16, None),
    (257, 4, 60, 32, None),
    (300, 8, 128, 16, None),
    (301, 8, 128, 64, "few"),
    (131, 1, 60, 16, "one"),
    (50, 8, 1000, 16, None),
    (3, 1, 5, 4, None),
]


def align_ids(num_tokens, top_k, num_experts, kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "one":
        return torch.full((num_tokens, top_k), num_experts - 1)
    high = 3 if kind == "few" else num_experts
    if top_k == 1 or kind == "few":
        return torch.randint(0, high, (num_tokens, top_k), generator=g)
    return torch.argsort(torch.rand(num_tokens, num_experts, generator=g), dim=1)[:, :top_k]   # distinct per token


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty filled with -7: an output row or a scratch entry (counts, cursors) the align kernels read
    or return without writing shows up, instead of whatever a reused allocation held."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: empty(*args, **kwargs).fill_(-7))


@pytest.mark.parametrize("num_programs", [1, 2, 7, None])
@pytest.mark.parametrize("case", ALIGN_CASES, ids=lambda c: "T{}-k{}-E{}-bm{}-{}".format(*c))
def test_moe_align_matches_the_torch_grouping(case, num_programs, poisoned_empty):
    # 1: the one-program kernel; 2 and 7: the two-launch path (2: over 1024 pairs per program, several tiles);
    # None: what moe_align picks (the two-launch path for the 2,400 pairs of T300-k8)
    pytest.importorskip("triton")
    num_tokens, top_k, num_experts, block_m, kind = case
    ids = align_ids(num_tokens, top_k, num_experts, kind)
    got = ma.moe_align(ids.to(DEVICE), num_experts, block_m, num_programs=num_programs)
    assert_aligned(ids, num_experts, block_m, *got)


def test_moe_align_takes_int32_ids_and_rejects_bad_program_counts(poisoned_empty):
    pytest.importorskip("triton")
    ids = align_ids(40, 2, 8, None).to(torch.int32)
    assert_aligned(ids, 8, 16, *ma.moe_align(ids.to(DEVICE), 8, 16, num_programs=3))
    with pytest.raises(ValueError, match="moe_align num_programs=0 must be >= 1"):
        ma.moe_align(ids.to(DEVICE), 8, 16, num_programs=0)


def test_align_num_programs_one_launch_for_decode_then_one_program_per_1024_rows():
    # rows = pairs + E * (block_m - 1) at most; 128 experts: at most 8192 // 128 = 64 programs
    assert [ma.align_num_programs(n, 128, 16) for n in (1, 1024, 1025, 16384, 65536, 262144)] == [1, 1, 3, 18, 64, 64]
    assert ma.align_num_programs(65536, 1024, 16) == 8       # 8 programs * 1024 counts each scatter program reads
    assert ma.align_num_programs(16384, 8, 128) == 17        # Mixtral, 8192 tokens of top-2: 17,400 rows
    assert ma.parallel_align_programs(100, 60, 16) == 2
    assert [ma.expert_pad(e) for e in (1, 8, 16, 17, 60, 128, 1000)] == [16, 16, 16, 32, 64, 128, 1024]


# (T, E, H, I, k, forced ids): tails of every tile, T=1, k=1, an expert nobody picks, all on one expert
FUSED_CASES = [
    (5, 4, 40, 24, 2, None),
    (1, 8, 32, 16, 1, None),
    (17, 3, 48, 40, 3, None),
    (20, 4, 24, 20, 1, torch.full((20, 1), 2)),
]


@pytest.mark.parametrize("case,dtype", [(c, torch.float32) for c in FUSED_CASES] +
                         [(FUSED_CASES[i], torch.bfloat16) for i in (0, 2)],
                         ids=lambda c: "T{}-E{}-H{}-I{}-k{}".format(*c[:5]) if isinstance(c, tuple) else str(c)[6:])
def test_fused_moe_matches_reference(case, dtype):
    pytest.importorskip("triton")
    num_tokens, num_experts, hidden, inter, top_k, ids = case
    x, w13, w2, weights, ids = random_moe(num_tokens, num_experts, hidden, inter, top_k, dtype, num_tokens, ids)
    got = fm.fused_moe(x, w13, w2, weights, ids, config=TINY)
    assert got.shape == (num_tokens, hidden) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, fm.moe_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
    else:   # against fp32 math on the same bf16 weights: one bf16 rounding of the activation and output
        expected = fm.moe_reference(x.float(), w13.float(), w2.float(), weights, ids)
        torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)


def test_fused_moe_matches_reference_through_the_parallel_align(monkeypatch, poisoned_empty):
    pytest.importorskip("triton")
    monkeypatch.setattr(ma, "ALIGN_ONE_PROGRAM_MAX_PAIRS", 0)
    monkeypatch.setattr(ma, "ALIGN_ROWS_PER_PROGRAM", 32)       # 111 pairs, up to 201 rows -> 7 programs
    x, w13, w2, weights, ids = random_moe(37, 6, 32, 24, 3, seed=5)
    assert ma.align_num_programs(ids.numel(), 6, TINY["BLOCK_SIZE_M"]) == 7
    got = fm.fused_moe(x, w13, w2, weights, ids, config=TINY)
    torch.testing.assert_close(got, fm.moe_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_fused_moe_default_config_strided_inputs_int32_ids_bf16_weights():
    # Qwen3-MoE rounds its routing weights to the model dtype (transformers does); the kernel takes any
    pytest.importorskip("triton")
    x, w13, w2, weights, ids = random_moe(6, 4, 48, 32, 2, seed=7)
    weights = weights.bfloat16()
    wide = torch.randn(6, 80, device=DEVICE)
    wide[:, 8:56] = x                                              # x as a column slice of a wider tensor
    w2_t = w2.transpose(1, 2).contiguous().transpose(1, 2)         # w2 with unit stride along H, not I
    got = fm.fused_moe(wide[:, 8:56], w13, w2_t, weights, ids.to(torch.int32))
    torch.testing.assert_close(got, fm.moe_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_bad_shapes_and_configs_raise_one_line_errors():
    x, w13, w2, weights, ids = random_moe(2, 4, 16, 16, 2)
    with pytest.raises(ValueError, match=r"weights do not fit x \[T, H=16\]"):
        fm.moe_reference(x, w13, w2[:, :8], weights, ids)
    with pytest.raises(ValueError, match=r"topk_weights and topk_ids must both be \[T=2, k\]"):
        fm.moe_reference(x, w13, w2, weights[:, :1], ids)
    with pytest.raises(ValueError, match="must share one dtype"):
        fm.moe_reference(x.double(), w13, w2, weights, ids)
    with pytest.raises(ValueError, match="topk_ids holds expert 9 but the weights have 4 experts"):
        fm.moe_reference(x, w13, w2, weights, torch.full_like(ids, 9))
    pytest.importorskip("triton")
    with pytest.raises(ValueError, match="BLOCK_SIZE_K=24 must be a power of two"):
        fm.fused_moe(x, w13, w2, weights, ids, config=fm.make_config(16, 16, 24, 1, 4, 1))
    with pytest.raises(ValueError, match="fused_moe takes at most 1024 experts, got 1025"):
        fm.fused_moe(x, w13[:1].expand(1025, -1, -1), w2[:1].expand(1025, -1, -1), weights, ids)
    with pytest.raises(ValueError, match="needs exactly the keys"):
        fm.fused_moe(x, w13, w2, weights, ids, config={"BLOCK_SIZE_M": 16})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("one_program_max_pairs", [2048, 0], ids=["one-program-align", "parallel-align"])
def test_fused_moe_replays_in_a_cuda_graph_with_new_routing(monkeypatch, one_program_max_pairs):
    # decode captures the whole path (align included): no host sync, shapes fixed by T alone
    monkeypatch.setattr(ma, "ALIGN_ONE_PROGRAM_MAX_PAIRS", one_program_max_pairs)
    x, w13, w2, weights, ids = random_moe(8, 16, 256, 128, 4, torch.bfloat16, seed=3)
    fm.fused_moe(x, w13, w2, weights, ids)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.fused_moe(x, w13, w2, weights, ids)
    for seed in (4, 5):
        g = torch.Generator(device="cuda").manual_seed(seed)
        new_weights, new_ids = fm.select_experts(torch.randn(8, 16, device="cuda", generator=g), 4, True)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        x.copy_(torch.randn(x.shape, device="cuda", generator=g))
        graph.replay()
        expected = fm.moe_reference(x.float(), w13.float(), w2.float(), weights, ids)
        torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


def test_get_config_takes_the_nearest_tuned_entry(monkeypatch):
    small, big = fm.make_config(16, 32, 64, 1, 4, 5), fm.make_config(64, 128, 64, 8, 8, 3)
    monkeypatch.setitem(fm.TUNED_CONFIGS, (8, 64, 32, 2, "bfloat16"), {1: small, 512: big})
    assert fm.get_config(1, 8, 64, 32, 2, torch.bfloat16) == small
    assert fm.get_config(300, 8, 64, 32, 2, torch.bfloat16) == big
    assert fm.get_config(300, 8, 64, 32, 2, torch.float16) == fm.default_config(300, 8, 2, torch.float16)
    for m, dtype in itertools.product((1, 64, 4096, 65536), fm.FLOAT_DTYPES):   # valid, and fits Hopper
        cfg = fm.default_config(m, 128, 8, dtype)
        fm.check_config(cfg)
        tiles = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"]
        assert cfg["num_stages"] * fm.stage_bytes(*tiles, dtype.itemsize) <= fm.SMEM_BYTES, (m, dtype, cfg)


def test_moe_experts_dispatches_to_the_reference_off_cuda():
    x, w13, w2, weights, ids = [t.cpu() for t in random_moe(4, 4, 16, 16, 2)]
    assert not fm.fused_moe_applies(x)
    torch.testing.assert_close(fm.moe_experts(x, w13, w2, weights, ids), fm.moe_reference(x, w13, w2, weights, ids))


# ---- offsets past 2^31 (interpreter) and the sm_90 compile (no GPU needed) -----------------------------

def _huge_offset_check() -> None:
    """Experts whose weights start past element 2^31: w13 and w2 are views, one expert every 2^30 elements,
    of a tensor that is virtual memory (torch.empty on CPU commits only the pages touched). An int32
    expert offset would wrap (expert 2 sits at exactly 2^31) and read elsewhere, or fault."""
    num_experts, hidden, inter, expert_stride = 4, 32, 16, 2**30
    base = torch.empty((num_experts, expert_stride), dtype=torch.bfloat16)          # 8.6 GB virtual
    w13_numel, w2_numel = 2 * inter * hidden, hidden * inter
    w13 = base.as_strided((num_experts, 2 * inter, hidden), (expert_stride, hidden, 1))
    w2 = base.as_strided((num_experts, hidden, inter), (expert_stride, inter, 1), storage_offset=w13_numel)
    gen = torch.Generator().manual_seed(9)
    for e in range(num_experts):
        base[e, :w13_numel + w2_numel] = (torch.randn(w13_numel + w2_numel, generator=gen) / 5).bfloat16()
    ids = torch.tensor([[3, 2], [1, 3], [2, 0]])
    weights = torch.rand(ids.shape, generator=gen)
    x = torch.randn(3, hidden, generator=gen).bfloat16()
    got = fm.fused_moe(x, w13, w2, weights, ids, config=fm.make_config(16, 16, 16, 1, 4, 1))
    expected = fm.moe_reference(x.float(), w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)
    print("ok: fused_moe at expert offsets up to", (num_experts - 1) * expert_stride + w13_numel + w2_numel)


@pytest.mark.skipif(not INTERPRET, reason="the interpreter reads CPU memory; on a GPU this needs 8 GB of weights")
def test_offsets_past_2_to_the_31_in_the_interpreter():
    pytest.importorskip("triton")
    # a subprocess, so a wrapped offset that faults fails this test instead of killing pytest
    done = subprocess.run([sys.executable, __file__, "--huge-offset-check"], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    if done.returncode != 0 and "DefaultCPUAllocator" in done.stderr:
        pytest.skip("cannot reserve 8.6 GB of virtual memory here")
    assert done.returncode == 0 and "ok: fused_moe at expert offsets" in done.stdout, \
        f"rc={done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"


def _compile_check() -> None:
    """Compile both kernels for sm_90 as a real launch specialises them (16-divisible pointers and strides,
    unit strides along H and I) with get_config's bf16 defaults for decode and the widest prefill, and the
    align kernels (one program; counts and scatter) for 8, 128 and 1024 experts; ptxas -v must report no
    register spills, shared memory must fit Hopper's 227 KiB, and the GEMMs' loads must be software-pipelined
    (they are not when a stride is unknown)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))      # tests/ (a script here)
    from triton_interpreter import compile_sm90
    index_ptrs = {"sorted_pair_ids_ptr": "*i64", "block_experts_ptr": "*i64", "weights_ptr": "*fp32"}

    def build(kernel, dtype, consts, cfg, pipelined=True):
        unit = {n: 1 for n in kernel.arg_names
                if n in ("stride_xh", "stride_wh", "stride_ai", "stride_wi", "stride_oh")}
        consts = {**consts, **unit}
        sig = {n: "constexpr" if n in consts else index_ptrs.get(n, f"*{dtype}") if n.endswith("_ptr") else "i32"
               for n in kernel.arg_names}
        divisible = {n for n in kernel.arg_names
                     if sig[n].startswith("*") or n.startswith("stride_") and n not in consts}
        compiled, spills, report = compile_sm90(kernel, sig, consts, divisible,
                                                {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
        copies = "async_copy_global_to_local" in compiled.asm["ttgir"]     # loads software-pipelined
        print(f"{kernel.__name__} {dtype} {cfg}: shared {compiled.metadata.shared} B, spills {spills} B, "
              f"pipelined {copies}")
        assert spills == 0 and compiled.metadata.shared <= 227 * 1024 and copies >= pipelined, report

    for (num_experts, top_k, hidden, inter), m in (((128, 8, 2048, 768), 1), ((8, 2, 4096, 14336), 8192)):
        cfg = fm.get_config(m, num_experts, hidden, inter, top_k, torch.bfloat16)
        consts = dict(HIDDEN=hidden, INTER=inter, NUM_EXPERTS=num_experts, BLOCK_M=cfg["BLOCK_SIZE_M"],
                      BLOCK_N=cfg["BLOCK_SIZE_N"], BLOCK_K=cfg["BLOCK_SIZE_K"], GROUP_M=cfg["GROUP_SIZE_M"],
                      PRECISION="tf32")
        build(fm._gate_up_kernel, "bf16", {**consts, "TOP_K": top_k}, cfg)
        build(fm._down_kernel, "bf16", consts, cfg)
    for m in (256, 8192):                   # fp32's own tiles (IEEE dots spill in the 16-bit wide ones)
        cfg = fm.get_config(m, 8, 4096, 14336, 2, torch.float32)
        consts = dict(HIDDEN=4096, INTER=14336, NUM_EXPERTS=8, BLOCK_M=cfg["BLOCK_SIZE_M"], BLOCK_N=cfg["BLOCK_SIZE_N"],
                      BLOCK_K=cfg["BLOCK_SIZE_K"], GROUP_M=cfg["GROUP_SIZE_M"], PRECISION="ieee")
        build(fm._gate_up_kernel, "fp32", {**consts, "TOP_K": 2}, cfg)
        build(fm._down_kernel, "fp32", consts, cfg)
    index_ptrs.update(ids_ptr="*i64", sorted_pair_ids_ptr="*i32", block_experts_ptr="*i32", cursor_ptr="*i32",
                      counts_ptr="*i32")
    for e_pad in (16, 128, 1024):           # the align kernels as moe_align launches them
        tiles = dict(E_PAD=e_pad, TILE=ma.ALIGN_TILE)
        blocks = max(16, 8192 // e_pad)
        build(ma._align_kernel, "i32", dict(BLOCKS_PER_ITER=blocks, **tiles), dict(num_warps=8, num_stages=1),
              pipelined=False)
        build(ma._align_count_kernel, "i32", tiles, dict(num_warps=4, num_stages=1), pipelined=False)
        build(ma._align_scatter_kernel, "i32", dict(PROGRAMS_PER_ITER=min(32, 4096 // e_pad), BLOCKS_PER_ITER=blocks,
                                                    **tiles), dict(num_warps=4, num_stages=1), pipelined=False)
    print("ok: the kernels compile for sm_90 without spills")


def test_kernels_compile_for_sm90_without_spills():
    from triton_interpreter import run_compile_check
    run_compile_check(__file__, "ok: the kernels compile")


if __name__ == "__main__" and sys.argv[1:] == ["--huge-offset-check"]:
    _huge_offset_check()
if COMPILE_CHECK:
    _compile_check()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_warm_up_runs_each_distinct_config_once():
    from kvfit.kernels.fused_moe import get_config, warm_up
    w13 = torch.randn(8, 2 * 32, 64, device="cuda", dtype=torch.bfloat16) * 0.05
    w2 = torch.randn(8, 64, 32, device="cuda", dtype=torch.bfloat16) * 0.05
    count = warm_up(w13, w2, 2, 1000)
    configs = {tuple(sorted(get_config(m, 8, 64, 32, 2, torch.bfloat16).items())) for m in range(1, 1001)}
    assert count == len(configs)


def test_warm_up_is_a_no_op_off_the_fused_path():
    from kvfit.kernels.fused_moe import warm_up
    assert warm_up(torch.zeros(4, 16, 8), torch.zeros(4, 8, 8), 2, 64) == 0
