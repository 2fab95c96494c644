"""Tensor parallelism on CPU (2 ranks over gloo): the sharded model gives transformers' logits.

Covers KV heads split across ranks, one KV head replicated on both (MQA), q/k/v bias (Qwen2), an
o_proj bias added once after the all-reduce (Llama attention_bias), a vocab-parallel embedding
and lm_head over a vocabulary 2 does not divide, tied (Qwen3 with q/k norm), Mistral, and experts
(Mixtral; Qwen2-MoE with its shared expert). Every rank must end
with the same full logits. In-process: the loader reads only each rank's slice of each tensor.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from paged_batch import hf_logits, random_tokens
from safetensors.torch import load_file
from tp_ranks import rank_main, spy_safetensors_reads

from kvfit.attention.torch_ref import TorchReferenceBackend
from kvfit.errors import ConfigError
from kvfit.model_facts import load_model_facts
from kvfit.models import loader
from kvfit.models.llama import CausalLM
from kvfit.models.parallel import check_tensor_parallel, read_shard, read_slice, vocab_range
from tiny_models import make_tiny_model


def test_two_ranks_match_transformers(tmp_path, tiny_llama, tiny_qwen2):
    from transformers import AutoModelForCausalLM
    mqa_bias = make_tiny_model(tmp_path, arch="llama", num_kv_heads=1, attention_bias=True, seed=4)
    tied_odd_vocab = make_tiny_model(tmp_path, arch="qwen3", vocab_size=321, tie_word_embeddings=True, seed=5)
    # the fused q/k/v and gate/up of every family, experts and a shared expert split over ranks too
    others = [make_tiny_model(tmp_path, arch=arch, seed=6 + i, name=f"tp-{arch}")
              for i, arch in enumerate(("mistral", "mixtral", "qwen2_moe"))]
    folders = [tiny_llama, tiny_qwen2, mqa_bias, tied_odd_vocab, *others]
    tokens = random_tokens(load_model_facts(tiny_llama).vocab_size, 14, seed=3)
    out_file = str(tmp_path / "logits.pt")
    mp.spawn(rank_main, args=(2, str(tmp_path / "init"), folders, tokens, 10, out_file), nprocs=2, join=True)
    results = torch.load(out_file)
    for folder in folders:
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        expected = hf_logits(hf, tokens)
        assert results[folder].shape == expected.shape, folder
        assert torch.allclose(results[folder], expected, atol=1e-4), folder


def test_heads_that_do_not_split_are_a_config_error(tiny_llama):
    facts = load_model_facts(tiny_llama)          # 4 query heads, 2 kv heads
    with pytest.raises(ConfigError, match="--tensor-parallel-size 3"):
        CausalLM(facts, torch.float32, "cpu", TorchReferenceBackend(), tp_rank=0, tp_size=3)


def test_check_tensor_parallel_names_what_does_not_split():
    check_tensor_parallel(num_heads=8, num_kv_heads=2, intermediate_size=64, vocab_size=321, tp_size=4)
    with pytest.raises(ConfigError, match="6 attention heads"):
        check_tensor_parallel(num_heads=6, num_kv_heads=1, intermediate_size=64, vocab_size=320, tp_size=4)
    with pytest.raises(ConfigError, match="2 KV heads"):
        check_tensor_parallel(num_heads=6, num_kv_heads=2, intermediate_size=60, vocab_size=320, tp_size=3)
    with pytest.raises(ConfigError, match=r"MLP channels \(intermediate_size\)"):
        check_tensor_parallel(num_heads=4, num_kv_heads=2, intermediate_size=66, vocab_size=320, tp_size=4)
    with pytest.raises(ConfigError, match="5-token vocabulary"):
        check_tensor_parallel(num_heads=4, num_kv_heads=4, intermediate_size=64, vocab_size=5, tp_size=4)


def test_vocab_ranges_cover_the_vocabulary_once():
    for vocab, tp in [(320, 2), (321, 2), (151936, 8), (32001, 4), (7, 3)]:
        ranges = [vocab_range(vocab, r, tp) for r in range(tp)]
        assert ranges[0][0] == 0
        assert all(a + n == b for (a, n), (b, _) in zip(ranges, ranges[1:]))
        assert sum(n for _, n in ranges) == vocab and all(n > 0 for _, n in ranges)


def test_a_rank_reads_only_its_slices(tmp_path, monkeypatch):
    """Rank 1 of 2, loaded in-process: every parameter is its slice of the checkpoint, read lazily."""
    folder = make_tiny_model(tmp_path, arch="qwen2", num_kv_heads=1, vocab_size=321)
    reads = spy_safetensors_reads(monkeypatch)
    facts = load_model_facts(folder)
    model = loader.load_model(folder, facts, torch.float32, "cpu", TorchReferenceBackend(), tp_rank=1, tp_size=2)
    full = load_file(f"{folder}/model.safetensors")
    # every checkpoint tensor read once, as its slice: a fused parameter's parts (q/k/v, gate/up) fill its rows
    pieces = {name: (param, index) for name, (_, param, index) in model.checkpoint_targets().items()}
    assert dict(reads) == {name: tuple(_piece(param, index).shape) for name, (param, index) in pieces.items()}
    for name, (param, index) in pieces.items():
        part = param.parts[index] if hasattr(param, "parts") else None
        want = read_shard(param, full[name]) if part is None else read_slice(part.shard, full[name])
        assert torch.equal(_piece(param, index), want), name
    # the shapes rank 1 of 2 holds: half the query heads, the one (replicated) KV head, the vocab's tail
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj.weight.shape[0] == (2 + 1 + 1) * facts.head_dim
    assert [part.size for part in attn.qkv_proj.parts] == [2 * facts.head_dim, facts.head_dim, facts.head_dim]
    assert model.model.embed_tokens.weight.shape[0] == 160 and model.lm_head.weight.shape[0] == 160


def _piece(param, index: int):
    """The rows of param that checkpoint part `index` fills (the whole parameter when it has no parts)."""
    return param[param.parts[index].rows] if hasattr(param, "parts") else param
