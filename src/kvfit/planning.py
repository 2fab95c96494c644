"""From settings and model facts to the planner's inputs (KVSpec, PlanLimits). No torch.

Above kv/ (which knows nothing of EngineConfig) and below the engine, the runner and `kvfit plan`.
"""

from __future__ import annotations

from kvfit.config import AUTO_MAX_MODEL_LEN, EngineConfig
from kvfit.errors import ConfigError
from kvfit.kv.plan import PlanLimits
from kvfit.kv.spec import KVSpec
from kvfit.model_facts import DTYPE_ALIASES, ModelFacts
from kvfit.sampling_params import PROMPT_LOGPROBS_SLICE


# A step's sequence lengths and query offsets are int32 on the device (runner/batch.py): no request is longer.
MAX_SEQUENCE_TOKENS = 2**31 - 1

# Steps that carry prefill chunks (alone or with decodes) of up to this many tokens run as graphs too: eagerly,
# launching one such step takes the host 10-13 ms on an H100 whatever its size (qwen3-0.6b, llama-3.1-8b), while
# the device runs qwen3-0.6b's 1,080 tokens in 5.2 ms (benchmarks/probe_mixed_step.py, 2026-12-07). Buckets are
# kept only where a graph is measured faster (runner/cuda_graphs.py choose_mixed_buckets), since a padded bucket
# costs device time.
MIXED_BUCKETS = (32, 64, 96, 128, 192, 256, 320, 384, 512, 640, 768, 1024, 1280, 1536, 2048)
MIXED_TP_MAX_TOKENS = 512     # with tensor parallelism (every rank must pick the same graphs): vLLM's default


def mixed_buckets(max_num_batched_tokens: int, tensor_parallel: bool) -> list[int]:
    """Candidate token counts for mixed-step graphs, smallest first (the largest: the step's token budget, or
    MIXED_BUCKETS' last; MIXED_TP_MAX_TOKENS under tensor parallelism)."""
    cap = min(max_num_batched_tokens, MIXED_TP_MAX_TOKENS if tensor_parallel else MIXED_BUCKETS[-1])
    return [b for b in MIXED_BUCKETS if b < cap] + ([cap] if cap > 1 else [])


def resolve_max_model_len(facts: ModelFacts, requested: int | str | None) -> int:
    """The requested context length, or the model's; longer than the model's is an error, and so is a model
    length past MAX_SEQUENCE_TOKENS taken by default. For "auto" the model's too (at most MAX_SEQUENCE_TOKENS):
    the upper bound that sizing (block-table rows, graphs) may use; the plan lowers it to what one request can
    hold (KVPlan.max_model_len). A model with a sliding window (facts.sliding_window) is limited to it:
    kvfit attends over the whole context, which gives the model's outputs only while a sequence fits the window."""
    window, context = facts.sliding_window, facts.context_len
    longest = context if window is None else min(window, context)
    what = (f"max_position_embeddings {facts.max_position_embeddings}" if context == facts.max_position_embeddings
            else f"rope-scaled context {context}" if facts.rope_context is not None
            else f"longrope context {context} (original_max_position_embeddings: kvfit runs LongRoPE's short "
                 "factors only)")
    if requested == AUTO_MAX_MODEL_LEN:
        return min(longest, MAX_SEQUENCE_TOKENS)
    if requested is None:
        if longest > MAX_SEQUENCE_TOKENS:
            raise ConfigError(
                f"the model's {what} is longer than the "
                f"{MAX_SEQUENCE_TOKENS:,} tokens a sequence can have here (int32 sequence lengths); pass "
                "--max-model-len (or --max-model-len auto)")
        return longest
    if requested > context:
        raise ConfigError(f"--max-model-len {requested} is longer than the model's {what}; use at most {context}")
    if requested > longest:
        raise ConfigError(
            f"--max-model-len {requested} is longer than the model's sliding_window {window}: kvfit attends over the "
            f"whole context, not a window, so longer sequences would not get the model's outputs; use at most {window}")
    if requested > MAX_SEQUENCE_TOKENS:
        raise ConfigError(f"--max-model-len {requested} is longer than the {MAX_SEQUENCE_TOKENS:,} tokens a sequence "
                          f"can have here (int32 sequence lengths); use at most {MAX_SEQUENCE_TOKENS}")
    return requested


def resolve_model_dtype(facts: ModelFacts, requested: str) -> str:
    """--dtype as a canonical name (float32, bfloat16, float16): the checkpoint's torch_dtype for "auto".
    The one resolver: the runner loads the weights in it, an "auto" KV cache follows it, the loading line
    and the start-up estimates name it."""
    return facts.torch_dtype if requested == "auto" else DTYPE_ALIASES[requested.lower()]


def resolve_max_logprobs(facts: ModelFacts, requested: int) -> int:
    """--max-logprobs as a count: -1 is the whole vocabulary; never more than the vocabulary."""
    return facts.vocab_size if requested == -1 else min(requested, facts.vocab_size)


def spec_and_limits(facts: ModelFacts, config: EngineConfig, max_element_offset: int,
                    backend: str) -> tuple[KVSpec, PlanLimits]:
    """The KVSpec for this rank and every limit besides memory."""
    spec = KVSpec.from_model(facts, config.cache.block_size, config.cache.kv_cache_dtype,
                             config.parallel.tensor_parallel_size,
                             model_dtype=resolve_model_dtype(facts, config.model.dtype))
    limits = PlanLimits(
        max_model_len=resolve_max_model_len(facts, config.model.max_model_len),
        num_gpu_blocks_override=config.cache.num_gpu_blocks_override,
        max_num_blocks=config.cache.max_num_blocks, max_element_offset=max_element_offset, backend=backend,
        max_model_len_auto=config.model.max_model_len == AUTO_MAX_MODEL_LEN)
    return spec, limits


# The runner's persistent batch (runner/input_batch.py) lives on the device from the profile on, so its
# bytes are part of the measured activation peak; this is their one definition, for the estimate.
SAMPLING_ROW_BYTES = 6 * 4 + 8      # temperature, top_p, top_k, three penalties (4 bytes each); a seed (8)
BLOCK_ID_BYTES = 4                  # int32 block ids in the block table


def token_history_applies(vocab_size: int, max_row_tokens: int | None) -> bool:
    """Whether the penalties' per-row record is the token ids (runner/token_counts.TokenHistory: 4 bytes per
    position, max_model_len + 1 of them, and two int64 lengths) rather than counts per token id (4 bytes per id):
    whichever is smaller, so the reserve is the smaller of the two. Building a step's counts from ids costs
    temporaries per penalised row (about 21 bytes a position and 8 a token id) that stay under the sort's 36
    bytes a logit the profile measures, so only the persistent bytes decide."""
    return max_row_tokens is not None and 4 * (max_row_tokens + 1) + 16 < 4 * vocab_size


def token_record_row_bytes(vocab_size: int, max_row_tokens: int | None) -> int:
    """Device bytes per row of the penalties' record (token_history_applies says which)."""
    if token_history_applies(vocab_size, max_row_tokens):
        return 4 * (max_row_tokens + 1) + 16
    return 4 * vocab_size


def persistent_batch_bytes(max_num_seqs: int, max_blocks_per_seq: int, vocab_size: int,
                           with_sampling: bool = True, max_row_tokens: int | None = None) -> int:
    """Device bytes of the persistent batch: a block-table row per sequence slot, and on the rank that
    samples a sampling row each (parameters, and the penalties' record of its tokens: int32 counts per token
    id, or its token ids when max_row_tokens, the model length, is given and that is smaller)."""
    table = max_num_seqs * max_blocks_per_seq * BLOCK_ID_BYTES
    sampling = (max_num_seqs * (SAMPLING_ROW_BYTES + token_record_row_bytes(vocab_size, max_row_tokens))
                if with_sampling else 0)
    return table + sampling


# Logits sampled at once (runner/sampling_state.py samples in chunks of these rows). The sampler's temporaries
# (an edited fp32 copy, fp32 scaled logits, a sort's values and int64 indices, softmax and cumsum, the hash
# state, fp32 noise: about 40 bytes a logit) are [rows, V]; a step of more rows runs in chunks, so its peak is
# that of 2^22 logits (32 rows of a 131,072-id vocabulary, about 170 MB) whatever max_num_seqs is, instead of
# 1.3 GB at 256 rows x 151,936 ids (issue 32 (1)). The capacity estimate counts this many rows' temporaries.
MAX_SAMPLER_LOGITS = 1 << 22


def prompt_logprobs_slice(vocab_size: int) -> int:
    """Positions whose prompt logprobs are computed at once: their logits stay within the sampler's bound
    (MAX_SAMPLER_LOGITS), at most PROMPT_LOGPROBS_SLICE. The start-up profile runs one such slice, so the
    reserve for a prompt-logprobs request no longer grows to 256 positions of a whole vocabulary."""
    return max(1, min(PROMPT_LOGPROBS_SLICE, MAX_SAMPLER_LOGITS // vocab_size))


def sampler_chunk_rows(vocab_size: int) -> int:
    """Rows sample_step runs at once (the capacity estimate counts this many rows' temporaries)."""
    return max(1, MAX_SAMPLER_LOGITS // vocab_size)
