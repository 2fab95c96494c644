"""The capacity estimate's sampler term follows the bounded sampler: the LM head's logits for every row,
the sampler's fp32 temporaries for one chunk of rows (planning.sampler_chunk_rows) at a time, and prompt
logprobs for planning.prompt_logprobs_slice positions at a time."""

from __future__ import annotations

from kvfit.config import SchedulerConfig
from kvfit.model_facts import load_model_facts
from kvfit.planning import MAX_SAMPLER_LOGITS, prompt_logprobs_slice, sampler_chunk_rows
from kvfit.platforms.estimate import LOGIT_BYTES, PROMPT_LOGIT_BYTES, estimate_activation_bytes
from kvfit.sampling_params import PROMPT_LOGPROBS_SLICE


def _act(facts, rows: int) -> int:
    return estimate_activation_bytes(facts, SchedulerConfig(max_num_seqs=rows, max_num_batched_tokens=8192), 2, 1)


def test_rows_past_one_chunk_cost_only_their_logits():
    facts = load_model_facts("qwen3-0.6b")
    vocab, chunk = facts.vocab_size, sampler_chunk_rows(facts.vocab_size)
    assert chunk < 256
    assert _act(facts, 512) - _act(facts, 256) == 256 * 2 * vocab        # the LM head's bf16 logits only


def test_the_sampler_reserve_is_bounded_for_a_large_vocabulary():
    facts = load_model_facts("qwen3-0.6b")
    vocab = facts.vocab_size
    positions = prompt_logprobs_slice(vocab)
    assert positions * vocab <= MAX_SAMPLER_LOGITS < PROMPT_LOGPROBS_SLICE * vocab
    rows = 256
    sampled = (rows * 2 + sampler_chunk_rows(vocab) * (LOGIT_BYTES - 2)) * vocab
    unbounded = max(rows * LOGIT_BYTES, PROMPT_LOGPROBS_SLICE * PROMPT_LOGIT_BYTES) * vocab
    assert sampled < unbounded / 5                     # 0.24 GB instead of 1.6 GB for qwen3-0.6b


def test_dynamic_fp8_scratch_counts_the_norm_and_silu_inputs_side_by_side():
    """With dynamic FP8 activations the norm's fp8 copy of the hidden state (kernels.fp8.PreQuantized) lives
    through the MLP beside the SiLU's fp8 copy for down_proj: hidden + intermediate bytes a token, one each."""
    bf16 = load_model_facts("llama-3.1-8b")
    fp8 = load_model_facts("llama-3.1-8b", "fp8")
    assert fp8.quantization.activation != "static"
    tokens = 8192
    assert _act(fp8, 256) - _act(bf16, 256) == tokens * (bf16.hidden_size + bf16.intermediate_size)
