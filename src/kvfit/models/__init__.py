"""Models in plain torch: one Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) and its loader.

- registry.py: architecture name (config.json) -> model class; what is runnable (no torch)
- llama.py: CausalLM (forward -> hidden states, compute_logits, load_weights with HF names)
- layers.py, rope.py, parallel.py: RMSNorm, SwiGLU, RoPE (default, linear, llama3); tensor parallelism:
  column/row-parallel linears (fused q/k/v and gate/up), vocab-parallel embedding and lm_head, which slice
  each rank reads
- linear.py: which linear a projection is (16-bit, FP8, fused or split), chosen at construction
- loader.py: load_model (the registry's class; safetensors or dummy weights)
"""
