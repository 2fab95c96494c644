"""Known models (their public config.json values) and known GPUs (total bytes as torch reports them)."""

from __future__ import annotations

from kvfit.errors import ConfigError

_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}

MODELS: dict[str, dict] = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": _LLAMA31_ROPE,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001},
    "llama-3.1-70b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
        "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
        "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": _LLAMA31_ROPE,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001},
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645},
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645},
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
        "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": 151643, "eos_token_id": 151645},
    "qwen3-235b-a22b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 4096,
        "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 94,
        "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
        "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": 151643, "eos_token_id": 151645},
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645},
    "mistral-7b": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 32768, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2},
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2},
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "vocab_size": 129280, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
        "bos_token_id": 0, "eos_token_id": 1},
}

# Total device memory in bytes as torch.cuda.mem_get_info reports it. H200: measured on the lent
# machine (150,109,880,320). The others are the totals those cards commonly report; for an exact
# figure on your card pass --device-memory with what `kvfit profile` or torch prints.
GPUS: dict[str, int] = {
    "H200": 150_109_880_320,
    "H100-80GB": 85_029_158_912,
    "A100-80GB": 85_198_045_184,
    "A100-40GB": 42_505_273_344,
    "L40S": 47_697_362_944,
    "RTX-4090": 25_386_352_640,
}


def _normalise(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def model_config(name: str) -> dict:
    """The config.json dict of a catalog model; unknown names list the known ones."""
    for key, cfg in MODELS.items():
        if _normalise(name) == key:
            return dict(cfg)
    raise ConfigError(f"unknown model {name!r}: not a folder, not a config.json, and not in the catalog "
                      f"({', '.join(MODELS)})")


def gpu_total_bytes(name: str) -> int:
    """Total bytes of a known GPU; unknown names list the known ones and point at --device-memory."""
    for key, total in GPUS.items():
        if _normalise(name) == key.lower():
            return total
    raise ConfigError(f"unknown GPU {name!r}: known GPUs are {', '.join(GPUS)}; "
                      "or give the memory with --device-memory, e.g. --device-memory 80GiB")
