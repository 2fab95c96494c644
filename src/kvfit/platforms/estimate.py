"""A MemoryReading estimated without a device, for `kvfit plan`. Formulas in docs/capacity.md.

The GPU profile (`kvfit profile`) measures each of these parts; the constants here were set from
what it measured on an H200 (see docs/capacity.md), so `kvfit plan` predicts the profile's count.
"""

from __future__ import annotations

from kvfit.config import CacheConfig, SchedulerConfig
from kvfit.kv.plan import MemoryReading, device_budget_bytes
from kvfit.kv.spec import num_blocks_for_tokens
from kvfit.model_facts import DTYPE_BYTES, ModelFacts, get_architecture
from kvfit.quant_scheme import ACTIVATION_SCRATCH_BYTES, STATIC_ACTIVATION_SCRATCH_BYTES
from kvfit.planning import mixed_buckets, persistent_batch_bytes, prompt_logprobs_slice, sampler_chunk_rows
from kvfit.units import MiB

# CUDA context of one process (measured on the H200: ~527 MiB before any allocation).
CUDA_CONTEXT_BYTES = 527 * MiB
# cuBLAS / Triton workspaces and other memory torch's allocator does not see
# (measured on the H200: 322 MiB for qwen3-0.6b, 326 MiB for llama-3.1-8b).
NON_TORCH_BYTES = 320 * MiB
# Decode CUDA graphs: one pool shared by every batch-size bucket, holding the largest bucket's
# activations (the LM head runs outside the graphs). The graphs of steps with prefill chunks share it and add
# their own (estimate_graph_bytes).
CUDA_GRAPH_BYTES = 64 * MiB
# Bytes per logit of each sampled row at the sampler's worst (seeded rows with top-p, which the profile
# runs): the LM head's output in the model dtype (2) plus the sampler's temporaries (fp32 scaled logits,
# a full sort's values and int64 indices, softmax and cumsum, int64 hash state, fp32 noise): 1336 MiB
# for 256 rows x 151,936 ids measured on the H200 (2026-12-03), 36 bytes per logit. Rows whose logits are
# edited first (penalties, logit_bias, bad words, min_tokens, a grammar bitmask) keep an fp32 edited copy
# beside them: 4 more (estimated from the code, not yet measured); rows that want logprobs under a grammar keep a
# masked fp32 copy for them: 4 more.
LOGIT_BYTES = 2 + 4 + 4 + 36
# prompt_logprobs: planning.prompt_logprobs_slice positions of logits at a time: the LM head's output (2), its fp32
# copy and logsumexp's temporary (8), top-k and the rank's comparison (about 4); estimated.
PROMPT_LOGIT_BYTES = 2 + 12


def estimate_weights_bytes(facts: ModelFacts, dtype_bytes: int | None, tensor_parallel_size: int) -> int:
    """Parameters x bytes per parameter, split evenly over ranks (norms are negligible). With FP8 weights
    (facts.quantization) the linear layers' weights count one byte each plus their fp32 scales, and dtype_bytes
    (--dtype) applies to the rest (embedding, lm_head, norms, routers)."""
    if facts.quantization is not None:
        kept_bytes = dtype_bytes if dtype_bytes is not None else DTYPE_BYTES[facts.torch_dtype]
        total = (facts.quantized_params + (facts.num_params - facts.quantized_params) * kept_bytes
                 + facts.weight_scale_bytes)
        return total // tensor_parallel_size
    per_param = dtype_bytes if dtype_bytes is not None else facts.weight_dtype_bytes
    return facts.num_params * per_param // tensor_parallel_size


def _mlp_width(facts: ModelFacts) -> int:
    """The MLP's intermediate width a token goes through (routed experts: num_experts_per_tok of them)."""
    inter = facts.intermediate_size
    width_key = get_architecture(facts.architecture).expert_width_key
    if width_key is not None:
        inter = facts.raw.get(width_key, inter) * facts.raw.get("num_experts_per_tok", 1)
    return inter


def forward_token_elements(facts: ModelFacts, tensor_parallel_size: int) -> int:
    """Activation elements a token holds at the forward's peak: the MLP's gate, up and act(gate) * up, beside the
    residual stream and the normed input (measured on the H200: 284 MB for qwen3-0.6b, 940 MB for llama-3.1-8b
    at 8,192 tokens, with the sampler's logits)."""
    return 2 * facts.hidden_size + 3 * _mlp_width(facts) // tensor_parallel_size


def estimate_graph_bytes(facts: ModelFacts, sched: SchedulerConfig, act_dtype_bytes: int,
                         tensor_parallel_size: int) -> int:
    """The CUDA graphs' pool: the decode graphs' (CUDA_GRAPH_BYTES), and the graphs of steps with prefill chunks
    (runner/cuda_graphs.py MixedGraphs): the largest candidate bucket's forward activations and every bucket's
    output rows. An upper bound: the device keeps the buckets its timing favours."""
    buckets = mixed_buckets(sched.max_num_batched_tokens, tensor_parallel_size > 1)
    if not buckets:
        return CUDA_GRAPH_BYTES
    largest = buckets[-1] * forward_token_elements(facts, tensor_parallel_size)
    return CUDA_GRAPH_BYTES + (largest + sum(buckets) * facts.hidden_size) * act_dtype_bytes


def estimate_activation_bytes(facts: ModelFacts, sched: SchedulerConfig, act_dtype_bytes: int,
                              tensor_parallel_size: int) -> int:
    """Peak of one forward over max_num_batched_tokens tokens plus sampling max_num_seqs rows (or a
    prompt-logprobs slice, if larger)."""
    tokens = sched.max_num_batched_tokens
    tp = tensor_parallel_size
    inter = _mlp_width(facts)
    per_token = forward_token_elements(facts, tp)
    # the LM head's logits of every row (2 bytes each); the sampler's fp32 copies and temporaries exist
    # for one chunk of rows at a time (sample_step runs sampler_chunk_rows rows at once)
    rows = min(sched.max_num_seqs, tokens)
    sampled = rows * 2 + min(rows, sampler_chunk_rows(facts.vocab_size)) * (LOGIT_BYTES - 2)
    logits = max(sampled, min(prompt_logprobs_slice(facts.vocab_size), tokens) * PROMPT_LOGIT_BYTES) * facts.vocab_size
    # FP8 GEMMs quantize their input first. Static: an fp32 copy and the fp8 values beside it, at the widest
    # input. Dynamic: the fp8 values alone, but the norm's (made in its launch for qkv / gate_up / the experts,
    # kernels.fp8.PreQuantized) live through the MLP beside the SiLU's for down_proj
    scratch = 0
    if facts.quantization is not None:
        if facts.quantization.activation == "static":
            scratch = tokens * STATIC_ACTIVATION_SCRATCH_BYTES * max(facts.hidden_size, inter // tp)
        else:
            scratch = tokens * ACTIVATION_SCRATCH_BYTES * (facts.hidden_size + inter // tp)
    return tokens * per_token * act_dtype_bytes + logits + scratch


def estimate_reading(facts: ModelFacts, total_bytes: int, cache: CacheConfig, sched: SchedulerConfig,
                     tensor_parallel_size: int = 1, dtype_bytes: int | None = None,
                     max_model_len: int | None = None) -> MemoryReading:
    """What a GPU of total_bytes would measure at start-up (rank 0), from documented formulas."""
    weights = estimate_weights_bytes(facts, dtype_bytes, tensor_parallel_size)
    max_len = max_model_len or facts.context_len
    batch = persistent_batch_bytes(sched.max_num_seqs, num_blocks_for_tokens(max_len, cache.block_size),
                                   facts.vocab_size, max_row_tokens=max_len)
    act_bytes = dtype_bytes or (2 if facts.weight_dtype_bytes == 1 else facts.weight_dtype_bytes)
    return MemoryReading(
        total_bytes=total_bytes, budget_bytes=device_budget_bytes(total_bytes, cache.gpu_memory_utilization),
        weights_bytes=weights,
        activation_peak_bytes=estimate_activation_bytes(facts, sched, act_bytes, tensor_parallel_size) + batch,
        non_torch_bytes=NON_TORCH_BYTES,
        cuda_graph_bytes=estimate_graph_bytes(facts, sched, act_bytes, tensor_parallel_size),
        in_use_at_start_bytes=CUDA_CONTEXT_BYTES, kv_cache_memory_bytes=cache.kv_cache_memory,
        source="estimated")
