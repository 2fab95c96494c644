"""The one-token Triton GEMV against F.linear (Triton's interpreter on CPU, the real kernel on a GPU)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kvfit.kernels import fused_ops, gemv  # noqa: E402
from kvfit.kv.spec import PADDING_SLOT_ID  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("n,k,config", [(37, 100, (8, 64, 4, 1)), (64, 512, (8, 512, 4, 3)),
                                        (5, 1030, (16, 256, 4, 2)), (130, 96, (4, 1024, 4, 3)),
                                        (3, 100, (1, 64, 4, 1)), (7, 300, None), (9, 8200, None)])
def test_gemv_matches_linear(n, k, config):
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=g).to(DEVICE)
    w = torch.randn(n, k, generator=g).to(DEVICE)
    torch.testing.assert_close(gemv.gemv(x, w, config=config), x @ w.T, rtol=1e-4, atol=1e-4)
    b = torch.randn(n, generator=g).to(DEVICE)
    torch.testing.assert_close(gemv.gemv(x, w, b, config=config), x @ w.T + b, rtol=1e-4, atol=1e-4)


def test_config_by_weight_shape():
    # long rows: one row per program; many rows: 2 x 4096; else 2 x 1024; BLOCK_K no wider than K needs
    assert gemv.config_for(4096, 14336) == gemv.LONG_ROW_CONFIG
    assert gemv.config_for(128256, 4096) == gemv.MANY_ROWS_CONFIG
    assert gemv.config_for(6144, 4096) == gemv.DEFAULT_CONFIG
    assert gemv.config_for(32000, 1000)[1] == 1024 and gemv.config_for(64, 100)[1] == 128


def test_gemv_reads_rows_of_a_strided_weight():
    # a weight that is a row slice of a wider matrix (stride(0) > K), as sharded weights can be
    big = torch.randn(20, 80).to(DEVICE)
    w = big[:, 16:64]
    x = torch.randn(1, 48).to(DEVICE)
    torch.testing.assert_close(gemv.gemv(x, w, config=(8, 32, 4, 1)), x @ w.T, rtol=1e-4, atol=1e-4)


def test_linear_falls_back_to_torch_off_cuda_or_with_more_rows():
    x2 = torch.randn(2, 16)
    w = torch.randn(8, 16)
    b = torch.randn(8)
    torch.testing.assert_close(gemv.linear(x2, w, b), torch.nn.functional.linear(x2, w, b))
    assert not gemv.gemv_applies(torch.randn(1, 16), w)              # CPU tensors: plain F.linear
    if torch.cuda.is_available():
        xc, wc, bc = x2[:1].cuda(), w.cuda(), b.cuda()
        assert gemv.gemv_applies(xc, wc)
        torch.testing.assert_close(gemv.linear(xc, wc, bc), torch.nn.functional.linear(xc, wc, bc),
                                   rtol=1e-4, atol=1e-4)


def silu_mul_reference(x, gate_up, bias, dtype):
    """silu(gate) * up as the unfused path computes it: the matmul rounded to dtype, then fp32 math."""
    y = (x.double() @ gate_up.double().T + (0 if bias is None else bias.double())).to(dtype).float()
    gate, up = y.chunk(2, dim=1)
    return (gate / (1.0 + torch.exp(-gate)) * up).to(dtype)


@pytest.mark.parametrize("n,k,config", [(37, 100, (4, 64, 4, 1)), (64, 512, (2, 512, 4, 1)), (5, 1030, None),
                                        (9, 300, (1, 128, 4, 1)), (16, 8200, None), (130, 96, (16, 128, 4, 1))])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_silu_mul_matches_the_two_kernel_path(n, k, config, bias):
    g = torch.Generator().manual_seed(n * k)
    x = torch.randn(1, k, generator=g).to(DEVICE)
    w = (torch.randn(2 * n, k, generator=g) / k ** 0.5).to(DEVICE)
    b = torch.randn(2 * n, generator=g).to(DEVICE) if bias else None
    got = gemv.gemv_silu_mul(x, w, b, config=config)
    assert got.shape == (1, n)
    torch.testing.assert_close(got, silu_mul_reference(x, w, b, torch.float32), rtol=1e-4, atol=1e-4)
    # bf16: the gate/up values round to bf16 before the SiLU, as the unfused matmul stores them (a rounding
    # that falls the other way in fp32 than in float64 moves the product by up to ~3 bf16 steps)
    xb, wb = x.bfloat16(), w.bfloat16()
    bb = b.bfloat16() if bias else None
    got = gemv.gemv_silu_mul(xb, wb, bb, config=config)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), silu_mul_reference(xb, wb, bb, torch.bfloat16).float(),
                               rtol=2.5e-2, atol=1e-2)
    # and the two-kernel path it replaces (the GEMV, then SiLU and product in fp32), on the same sums
    two = gemv.gemv(xb, wb, bb).float()
    gate, up = two.chunk(2, dim=1)
    torch.testing.assert_close(got, (gate / (1.0 + torch.exp(-gate)) * up).bfloat16(), rtol=1e-2, atol=1e-2)


def test_gemv_silu_mul_reads_a_shards_rows():
    # a rank's fused [gate shard; up shard] is its own tensor; a row slice (stride(0) > K) also works
    big = torch.randn(12, 80).to(DEVICE)
    w = big[:, 8:72]
    x = torch.randn(1, 64).to(DEVICE)
    torch.testing.assert_close(gemv.gemv_silu_mul(x, w, config=(2, 32, 4, 1)),
                               silu_mul_reference(x, w, None, torch.float32), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("heads,dtype,cache_dtype,bias,slot", [
    ((4, 2), torch.float32, torch.float32, True, 13),
    ((3, 1), torch.bfloat16, torch.bfloat16, False, 13),
    ((1, 1), torch.bfloat16, torch.float8_e4m3fn, True, 13),
    ((4, 2), torch.bfloat16, torch.float8_e4m3fn, False, PADDING_SLOT_ID),
])
def test_gemv_rope_write_kv_equals_the_projection_then_the_fused_rope_write(heads, dtype, cache_dtype, bias, slot):
    # bit-identical to what it replaces: gemv(), then qk_norm_rope_write_kv_ (no norms) on the row's q/k/v views
    num_q, num_kv = heads
    dim, k, page, num_blocks = 16, 72, 4, 5
    g = torch.Generator().manual_seed(num_q * 31 + num_kv + slot)
    rows = (num_q + 2 * num_kv) * dim
    x = torch.randn(1, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(rows, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    b = torch.randn(rows, generator=g).to(DEVICE, dtype) if bias else None
    pos = torch.tensor([4095]).to(DEVICE)
    freqs = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)).to(DEVICE)
    slots = torch.tensor([slot], dtype=torch.int64).to(DEVICE)
    k_start = torch.randn(num_blocks, page, num_kv, dim, generator=g).to(DEVICE, cache_dtype)
    v_start = torch.randn(num_blocks, page, num_kv, dim, generator=g).to(DEVICE, cache_dtype)
    config = (2, 64, 4, 1)
    ref = gemv.gemv(x, w, b, config=config)
    ref_k, ref_v = k_start.clone(), v_start.clone()
    views = (ref[:, :num_q * dim].view(1, num_q, dim), ref[:, num_q * dim:(num_q + num_kv) * dim].view(1, num_kv, dim),
             ref[:, (num_q + num_kv) * dim:].view(1, num_kv, dim))
    assert fused_ops.qk_norm_rope_write_kv_(*views, pos, freqs, None, None, 0.0, ref_k, ref_v, slots)
    got_k, got_v = k_start.clone(), v_start.clone()
    got = gemv.gemv_rope_write_kv(x, w, b, pos, freqs, got_k, got_v, slots, num_q, num_kv, config=config)
    assert torch.equal(got, ref)
    assert torch.equal(got_k.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), ref_v.view(torch.uint8))
    if slot == PADDING_SLOT_ID:
        assert torch.equal(got_k.view(torch.uint8), k_start.view(torch.uint8))


def test_gemv_rope_write_kv_pairs_per_program_and_default_config():
    # several pairs a program (the tile's rows span heads and the q/k/v boundaries) and the shape's own config
    num_q, num_kv, dim, k = 6, 2, 16, 96
    g = torch.Generator().manual_seed(3)
    rows = (num_q + 2 * num_kv) * dim
    x, w = torch.randn(1, k, generator=g).to(DEVICE), torch.randn(rows, k, generator=g).to(DEVICE)
    pos, slots = torch.tensor([7]).to(DEVICE), torch.tensor([5], dtype=torch.int64).to(DEVICE)
    freqs = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)).to(DEVICE)
    caches = [torch.zeros(3, 4, num_kv, dim).to(DEVICE) for _ in range(4)]
    ref = x @ w.T
    views = (ref[:, :num_q * dim].view(1, num_q, dim), ref[:, num_q * dim:(num_q + num_kv) * dim].view(1, num_kv, dim),
             ref[:, (num_q + num_kv) * dim:].view(1, num_kv, dim))
    assert fused_ops.qk_norm_rope_write_kv_(*views, pos, freqs, None, None, 0.0, caches[0], caches[1], slots)
    for config in ((8, 32, 4, 1), (4, 64, 4, 1), None):
        for c in caches[2:]:
            c.zero_()
        got = gemv.gemv_rope_write_kv(x, w, None, pos, freqs, caches[2], caches[3], slots, num_q, num_kv,
                                      config=config)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(caches[2], caches[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(caches[3], caches[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_a_one_token_attention_layer_through_the_fused_gemvs_equals_the_unfused_path(monkeypatch, qkv_bias):
    # llama.Attention and SwiGLU with the one-token GEMVs (the gate opened for CPU tensors here) against the
    # same modules on the plain path: same output, same cache contents
    from kvfit.attention import fused_write
    from kvfit.attention.base import AttentionMetadata
    from kvfit.attention.torch_ref import TorchReferenceBackend
    from kvfit.models import layers, llama
    from kvfit.models.rope import inv_freq
    from tiny_models import tiny_decoder_config

    class PlainWriteReference(fused_write.FusedCacheWrite, TorchReferenceBackend):
        """As the Triton backend: a plain write, so the fused one may stand in."""

    num_q, num_kv, dim, hidden, page = 4, 2, 16, 64, 4
    cfg = tiny_decoder_config(num_q, num_kv, dim, hidden, qkv_bias=qkv_bias)
    torch.manual_seed(4)
    attn = llama.Attention(cfg, PlainWriteReference(), torch.float32, DEVICE, 0, 1)
    mlp = layers.SwiGLU(hidden, 96, False, torch.float32, DEVICE)
    for module in (attn, mlp):
        for p in module.parameters():
            p.data.normal_(0, 0.2)
    freqs = inv_freq(cfg.rope, DEVICE)
    context = 9                                   # 8 cached tokens and this one
    cache_init = [torch.randn(4, page, num_kv, dim).to(DEVICE) for _ in range(2)]
    meta = AttentionMetadata(slot_mapping=torch.tensor([8], dtype=torch.int64, device=DEVICE),
                             query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
                             seq_lens=torch.tensor([context], dtype=torch.int32, device=DEVICE),
                             block_tables=torch.tensor([[0, 1, 2]], dtype=torch.int32, device=DEVICE),
                             max_query_len=1, max_seq_len=context, query_start_loc_host=[0, 1],
                             seq_lens_host=[context])
    x, positions = torch.randn(1, hidden).to(DEVICE), torch.tensor([context - 1]).to(DEVICE)
    calls = []
    for module, name in ((fused_write, "gemv_rope_write_kv"), (layers, "gemv_silu_mul")):
        inner = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, inner=inner, name=name, **k: (calls.append(name),
                                                                                 inner(*a, **k))[1])
    results = {}
    for fused in (False, True):
        gate = (lambda t, w: t.dim() == 2 and t.shape[0] == 1) if fused else (lambda t, w: False)
        monkeypatch.setattr(fused_write, "gemv_applies", gate)
        monkeypatch.setattr(layers, "gemv_applies", gate)
        caches = tuple(c.clone() for c in cache_init)
        out = attn(x, positions, caches, meta, freqs)
        results[fused] = (out, mlp(out), caches)
    (out, mlp_out, caches), (f_out, f_mlp_out, f_caches) = results[False], results[True]
    torch.testing.assert_close(f_out, out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(f_mlp_out, mlp_out, rtol=1e-5, atol=1e-5)
    for got, expected in zip(f_caches, caches):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert calls == ["gemv_rope_write_kv", "gemv_silu_mul"]      # the fused run, once each
    assert not torch.equal(caches[0], cache_init[0])          # the token was written (block 2, offset 0)
