"""kvfit's Triton kernels and their launchers; the attention backend, the layers and the runner call them.

- attention_common.py: the KV-cache write kernel and the tile helpers decode and prefill share (int64 offsets)
- attention_decode.py, attention_prefill.py: paged decode (split-K, cascade) and paged prefill attention
- fused_ops.py: the decoder's small ops fused (residual add + RMSNorm, q/k RMSNorm + RoPE, SiLU x mul)
- gemv.py: one-token linears (batch-1 decode), with the gate/up SiLU and the q/k/v RoPE + cache-write epilogues
- fused_moe.py, moe_align.py: mixture-of-experts routing, its torch reference and the grouped-GEMM experts
- fp8.py: FP8 weights (Fp8Weight), their quantization and the fp32 reference GEMM the FP8 kernels are held to
- fp8_gemm.py: the FP8 GEMM a quantized linear runs, chosen per call (fp8_gemv.py for one token, cuBLASLt's
  _scaled_mm, fp8_block_gemm.py, or the reference); fp8_quantize.py: activations quantized in one launch
- fp8_fused_experts.py: fused_moe's grouped GEMMs with FP8 experts
- greedy.py: the all-greedy step's argmax and finite-logits check in one read of the logits
- pdl.py: programmatic dependent launch, the contract every kernel with a `PDL` constexpr keeps

Whether a kernel runs on a tensor is asked of kvfit.platforms.gate (`triton_applies`, `on_gpu`), never of
the tensor's device here. Kernels import only that gate, kv's spec constants (PADDING_SLOT_ID), quant_scheme's
FP8 constants, errors, units and each other (tests/test_layering.py), so every layer above may call them.
"""
