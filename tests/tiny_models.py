"""Tiny random-weight Hugging Face model folders for tests, built with transformers' own classes.

`make_tiny_model(tmp_path, arch=...)` writes config.json + model.safetensors (or shards with an
index), generation_config.json, tokenizer.json (a byte-level BPE trained here on a small corpus)
and tokenizer_config.json (with a chat template when asked). Weights are drawn wider than HF's
init (and biases and norm weights are non-trivial) so a wrong or missing tensor changes the logits.
"""

from __future__ import annotations

import json
import os

import torch

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral")
UNK, BOS, EOS = "<unk>", "<s>", "</s>"   # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

CORPUS = """\
The quick brown fox jumps over the lazy dog. A paged key value cache stores attention keys and values
in fixed size blocks, so memory is allocated on demand and shared between sequences with a common prefix.
The scheduler decides which requests run in each step; the runner builds the input tensors and samples.
Hello world! How are you today? I am fine, thank you. What's the weather like? It's sunny and warm.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024. Symbols: + - * / = ( ) [ ] { } < > , . ; : ! ?
Once upon a time there was a little model that could count tokens, and it counted them very carefully.
In the beginning the engine measured the memory, planned the cache, and then served every request.
Les modèles de langue prédisent le prochain jeton. Über alle Berge. ¿Qué tal? 你好，世界。
"""


# Qwen2's pre-tokenizer regex: transformers 5 rebuilds this pipeline for Qwen2 folders whatever
# tokenizer.json says, so the tiny Qwen tokenizers use it too
QWEN_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                          r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


def train_tokenizer(vocab_size: int = 320, add_bos: bool = True, qwen_style: bool = False):
    """A byte-level BPE (any text encodes) with <unk> <s> </s> as ids 0 1 2; bos added when add_bos.

    qwen_style: NFC + Qwen2's split regex before the byte-level step (as Qwen2Tokenizer builds it).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE(unk_token=UNK))
    if qwen_style:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[UNK, BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines() * 4, trainer=trainer)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                           special_tokens=[(BOS, 1)])
    return tok


def train_byte_fallback_tokenizer(lines: list[str], specials=(UNK, BOS, EOS), vocab_size: int = 300):
    """A sentencepiece-style BPE (Metaspace "\u2581" words, <0xNN> byte pieces for anything untrained, the
    decoder Llama 2 / Mistral ship) trained on `lines`; specials take the first ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token=specials[0]))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                                       show_progress=False))
    state = json.loads(tok.to_str())
    vocab = state["model"]["vocab"]
    for byte in range(256):            # sentencepiece's byte pieces, after the trained ones
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    state["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(state))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


def _hf_config(arch: str, **kw):
    import transformers
    common = dict(vocab_size=kw["vocab_size"], hidden_size=kw["hidden_size"],
                  intermediate_size=kw["intermediate_size"], num_hidden_layers=kw["num_layers"],
                  num_attention_heads=kw["num_heads"], num_key_value_heads=kw["num_kv_heads"],
                  max_position_embeddings=kw["max_position_embeddings"], rms_norm_eps=1e-5,
                  rope_theta=kw["rope_theta"], tie_word_embeddings=kw["tie_word_embeddings"],
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kw["rope_scaling"] is not None:
        common["rope_scaling"] = dict(kw["rope_scaling"])
    if kw["head_dim"] is not None:
        common["head_dim"] = kw["head_dim"]
    if arch == "llama":
        return transformers.LlamaConfig(attention_bias=kw["attention_bias"], **common)
    if arch == "mistral":
        return transformers.MistralConfig(sliding_window=None, **common)
    if arch == "qwen2":
        return transformers.Qwen2Config(use_sliding_window=False, **common)
    if arch == "qwen3":
        return transformers.Qwen3Config(use_sliding_window=False, attention_bias=kw["attention_bias"], **common)
    moe = kw["moe"]
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            use_sliding_window=False, attention_bias=kw["attention_bias"], num_experts=moe.get("num_experts", 8),
            num_experts_per_tok=moe.get("top_k", 2), moe_intermediate_size=moe.get("moe_intermediate_size", 32),
            decoder_sparse_step=moe.get("decoder_sparse_step", 1), mlp_only_layers=moe.get("mlp_only_layers", []),
            norm_topk_prob=moe.get("norm_topk_prob", True), **common)
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            use_sliding_window=False, num_experts=moe.get("num_experts", 8), num_experts_per_tok=moe.get("top_k", 2),
            moe_intermediate_size=moe.get("moe_intermediate_size", 32),
            shared_expert_intermediate_size=moe.get("shared_expert_intermediate_size", 48),
            decoder_sparse_step=moe.get("decoder_sparse_step", 1), mlp_only_layers=moe.get("mlp_only_layers", []),
            norm_topk_prob=moe.get("norm_topk_prob", False), **common)
    if arch == "mixtral":
        common["intermediate_size"] = moe.get("moe_intermediate_size", common["intermediate_size"])
        return transformers.MixtralConfig(sliding_window=None, num_local_experts=moe.get("num_experts", 8),
                                          num_experts_per_tok=moe.get("top_k", 2), **common)
    raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")


@torch.no_grad()
def _randomize(model: torch.nn.Module, std: float) -> None:
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.2 * torch.randn_like(param))
        else:
            param.normal_(0.0, std)


def _tokenizer_config(arch: str, with_chat_template: bool) -> dict:
    llama_like = arch in ("llama", "mistral", "mixtral")
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "unk_token": UNK,
           "bos_token": BOS if llama_like else None, "model_max_length": 512,
           "clean_up_tokenization_spaces": False}
    if llama_like:
        cfg.update(add_bos_token=True, add_eos_token=False)
    else:
        cfg["pad_token"] = EOS
    if with_chat_template:
        cfg["chat_template"] = CHAT_TEMPLATE
    return cfg


def make_tiny_model(tmp_path, arch: str = "llama", num_kv_heads: int = 2, seed: int = 0, vocab_size: int = 320,
                    with_chat_template: bool = True, rope_scaling: dict | str | None = None,
                    tie_word_embeddings: bool = False, max_shard_size: str | None = None,
                    num_layers: int = 2, hidden_size: int = 64, num_heads: int = 4, head_dim: int | None = None,
                    intermediate_size: int = 128, max_position_embeddings: int = 512, rope_theta: float = 10000.0,
                    attention_bias: bool = False, weight_std: float = 0.1, name: str | None = None,
                    moe: dict | None = None) -> str:
    """Write a tiny HF model folder under tmp_path and return its path.

    arch: llama | mistral | qwen2 (q/k/v bias) | qwen3 (q/k norm; head_dim 32 != hidden/heads by default) |
    qwen3_moe | qwen2_moe | mixtral (mixture of experts; moe: num_experts (8), top_k (2), moe_intermediate_size (32;
    Mixtral's intermediate_size), decoder_sparse_step, mlp_only_layers, norm_topk_prob,
    shared_expert_intermediate_size (48, Qwen2-MoE)).
    rope_scaling: None, "llama3" (a llama 3.1 scaling) or a rope_scaling dict. max_shard_size (e.g.
    "40KB") saves sharded safetensors with model.safetensors.index.json.
    """
    import transformers
    if rope_scaling == "llama3":
        rope_scaling = LLAMA3_ROPE
    if arch in ("qwen3", "qwen3_moe") and head_dim is None:
        head_dim = 32
    folder = os.path.join(str(tmp_path), name or f"tiny-{arch}-kv{num_kv_heads}-seed{seed}")
    os.makedirs(folder, exist_ok=True)
    llama_like = arch in ("llama", "mistral", "mixtral")
    tok = train_tokenizer(vocab_size, add_bos=llama_like, qwen_style=not llama_like)
    torch.manual_seed(seed)
    config = _hf_config(arch, vocab_size=tok.get_vocab_size(), hidden_size=hidden_size,
                        intermediate_size=intermediate_size, num_layers=num_layers, num_heads=num_heads,
                        num_kv_heads=num_kv_heads, max_position_embeddings=max_position_embeddings,
                        rope_theta=rope_theta, rope_scaling=rope_scaling, tie_word_embeddings=tie_word_embeddings,
                        head_dim=head_dim, attention_bias=attention_bias, moe=moe or {})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, weight_std)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
        json.dump(_tokenizer_config(arch, with_chat_template), fh, indent=1)
    with open(os.path.join(folder, "generation_config.json"), "w", encoding="utf-8") as fh:
        json.dump({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}, fh)
    return folder


def make_loud_model(tmp_path, loud: float, **kwargs) -> str:
    """make_tiny_model's llama with k_proj and v_proj `loud` times larger and q_proj and o_proj `loud` times
    smaller: the same model in exact arithmetic (q . k and o_proj(v) unchanged), but with keys and values past an
    fp8 cache's range (448) for a large `loud` (the KV cache scale tests)."""
    from safetensors.torch import load_file, save_file
    folder = make_tiny_model(tmp_path, **kwargs)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    for name in tensors:
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            tensors[name] = tensors[name] * loud
        elif name.endswith(("q_proj.weight", "o_proj.weight")):
            tensors[name] = tensors[name] / loud
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


def tiny_decoder_config(num_q: int, num_kv: int, dim: int, hidden: int, qkv_bias: bool = False, qk_norm: bool = False):
    """A one-layer llama.DecoderConfig for layer tests (vocabulary 10, MLP width 96, RoPE without scaling)."""
    from kvfit.models import llama
    from kvfit.models.rope import rope_config_from_raw
    return llama.DecoderConfig(num_layers=1, hidden_size=hidden, num_heads=num_q, num_kv_heads=num_kv, head_dim=dim,
                               intermediate_size=96, vocab_size=10, rms_norm_eps=1e-6, qkv_bias=qkv_bias,
                               o_bias=False, mlp_bias=False, qk_norm=qk_norm, tie_word_embeddings=False,
                               rope=rope_config_from_raw({}, dim))
