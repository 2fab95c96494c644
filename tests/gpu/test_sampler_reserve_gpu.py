"""The sampler's reserve is bounded on a GPU (issue 32 (1)): the profiled activation peak grows with
--max-num-seqs only by what every row must hold (the LM head's output, the persistent batch's counts), not by
the sampler's fp32 temporaries (about 40 bytes a logit), which now run sampler_chunk_rows rows at a time.
The budget is derived from the GPU (gpu_capacity.gpu_budget); it does not change the activation peak.

Run: python -m pytest tests/gpu/test_sampler_reserve_gpu.py -q -s
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SETTINGS = dict(load_format="dummy", dtype="bfloat16", device="cuda", max_model_len=2048, max_num_batched_tokens=8192,
                enable_prefix_caching=False, enforce_eager=True)
KV_CACHE_BYTES, LEAST_KV_BYTES = 2 << 30, 1 << 30
# per extra row and vocabulary entry: the LM head's bf16 output (2), the persistent batch's int32 counts (4), the
# finite check and other per-row [rows, V] bytes the step keeps beside them (at most 6 more)
ROW_BYTES_PER_LOGIT = 12


def activation_peak(max_num_seqs: int) -> tuple[int, int]:
    from gpu_capacity import gpu_budget

    from kvfit import LLM
    settings = gpu_budget("qwen3-0.6b", {**SETTINGS, "max_num_seqs": max_num_seqs}, KV_CACHE_BYTES, LEAST_KV_BYTES)
    llm = LLM("qwen3-0.6b", **settings)
    try:
        return llm.engine.readings[0].activation_peak_bytes, llm.engine.facts.vocab_size
    finally:
        llm.shutdown()


def test_the_peak_grows_by_the_rows_not_by_the_sampler_temporaries():
    from kvfit.planning import sampler_chunk_rows
    small, vocab = activation_peak(32)
    large, _ = activation_peak(256)
    extra_rows = 256 - 32
    print(f"\nactivation peak: {small / 2**30:.3f} GiB at 32 rows, {large / 2**30:.3f} GiB at 256 rows; "
          f"chunk {sampler_chunk_rows(vocab)} rows; unchunked temporaries would add ~{extra_rows * vocab * 40 / 2**30:.2f} GiB")
    assert large - small <= extra_rows * vocab * ROW_BYTES_PER_LOGIT + (64 << 20)
