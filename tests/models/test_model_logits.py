"""kvfit's CausalLM (torch reference backend, fp32, paged cache) gives transformers' logits.

Covers Llama (GQA), Qwen2 (q/k/v bias), Qwen3 (q/k norm, head_dim != hidden/heads), Llama 3.1 RoPE
scaling with tied embeddings, Mistral with MQA; flat batches of several sequences; prefill then
decode and chunked prefill through block tables with scattered block ids; the cacheless path.
"""

from __future__ import annotations

import pytest
import torch
from paged_batch import PagedCache, hf_logits, random_tokens, step_logits

from kvfit.attention.torch_ref import TorchReferenceBackend
from kvfit.model_facts import load_model_facts
from kvfit.models.loader import load_model
from tiny_models import make_tiny_model

ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny_llama3_tied(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("models"), arch="llama", rope_scaling="llama3",
                           tie_word_embeddings=True, rope_theta=500000.0)


@pytest.fixture(scope="module")
def tiny_mistral_mqa(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("models"), arch="mistral", num_kv_heads=1, seed=3)


MODELS = ["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_llama3_tied", "tiny_mistral_mqa"]


def _load(folder: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM
    facts = load_model_facts(folder)
    ours = load_model(folder, facts, dtype, "cpu", TorchReferenceBackend())
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return facts, ours, hf


@pytest.mark.parametrize("fixture", MODELS)
def test_prefill_of_a_flat_batch_matches_transformers(fixture, request):
    facts, ours, hf = _load(request.getfixturevalue(fixture))
    seqs = {f"s{i}": random_tokens(facts.vocab_size, n, seed=i) for i, n in enumerate((5, 23, 1, 12))}
    cache = PagedCache(facts, block_size=4, num_blocks=40)
    got = step_logits(ours, cache, [(sid, 0, toks) for sid, toks in seqs.items()])
    for (sid, toks), logits in zip(seqs.items(), got):
        expected = hf_logits(hf, toks)
        assert logits.dtype == torch.float32 and logits.shape == expected.shape
        assert torch.allclose(logits, expected, atol=ATOL), f"{fixture} {sid}: {(logits - expected).abs().max()}"


@pytest.mark.parametrize("fixture", MODELS)
def test_chunked_prefill_then_decode_matches_full_sequence_logits(fixture, request):
    facts, ours, hf = _load(request.getfixturevalue(fixture))
    a, b = random_tokens(facts.vocab_size, 30, seed=10), random_tokens(facts.vocab_size, 19, seed=11)
    expected_a, expected_b = hf_logits(hf, a), hf_logits(hf, b)
    cache = PagedCache(facts, block_size=4, num_blocks=32, seed=5)
    # step 1: a's first chunk and all of b's prompt but 4 tokens
    got_a, got_b = step_logits(ours, cache, [("a", 0, a[:9]), ("b", 0, b[:15])])
    assert torch.allclose(got_a, expected_a[:9], atol=ATOL) and torch.allclose(got_b, expected_b[:15], atol=ATOL)
    # step 2: a's second chunk over its cached prefix, b decodes one token
    got_a, got_b = step_logits(ours, cache, [("a", 9, a[9:26]), ("b", 15, b[15:16])])
    assert torch.allclose(got_a, expected_a[9:26], atol=ATOL) and torch.allclose(got_b, expected_b[15:16], atol=ATOL)
    # decode steps: both sequences one token at a time, crossing block boundaries
    for step in range(3):
        pa, pb = 26 + step, 16 + step
        got_a, got_b = step_logits(ours, cache, [("b", pb, b[pb:pb + 1]), ("a", pa, a[pa:pa + 1])])[::-1]
        assert torch.allclose(got_a, expected_a[pa:pa + 1], atol=ATOL), f"{fixture} a@{pa}"
        assert torch.allclose(got_b, expected_b[pb:pb + 1], atol=ATOL), f"{fixture} b@{pb}"
    assert len(set(cache.tables["a"]) & set(cache.tables["b"])) == 0


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3"])
@torch.inference_mode()
def test_without_a_cache_each_sequence_attends_to_its_own_tokens(fixture, request):
    facts, ours, hf = _load(request.getfixturevalue(fixture))
    seqs = [random_tokens(facts.vocab_size, n, seed=20 + n) for n in (7, 16)]
    cache = PagedCache(facts, block_size=4, num_blocks=8)
    input_ids, positions, meta = cache.step([(f"s{i}", 0, t) for i, t in enumerate(seqs)])
    for kv_caches in (None, []):
        logits = ours.compute_logits(ours(input_ids, positions, kv_caches, meta))
        assert torch.allclose(logits[:7], hf_logits(hf, seqs[0]), atol=ATOL)
        assert torch.allclose(logits[7:], hf_logits(hf, seqs[1]), atol=ATOL)


def test_tied_embeddings_share_one_tensor(tiny_llama3_tied):
    facts, ours, _ = _load(tiny_llama3_tied)
    assert facts.tie_word_embeddings and ours.config.rope.rope_type == "llama3"
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    names = [n for n, _ in ours.named_parameters()]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


def test_family_flags(tiny_qwen2, tiny_qwen3, tiny_llama):
    _, qwen2, _ = _load(tiny_qwen2)
    _, qwen3, _ = _load(tiny_qwen3)
    _, llama, _ = _load(tiny_llama)
    assert qwen2.model.layers[0].self_attn.qkv_proj.bias is not None
    assert qwen2.model.layers[0].self_attn.o_proj.bias is None
    assert qwen3.model.layers[0].self_attn.q_norm is not None and qwen3.config.head_dim == 32
    assert llama.model.layers[0].self_attn.qkv_proj.bias is None and llama.model.layers[0].self_attn.q_norm is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_close_to_fp32(dtype, tiny_llama):
    facts, ours32, _ = _load(tiny_llama)
    ours16 = load_model(tiny_llama, facts, dtype, "cpu", TorchReferenceBackend())
    assert all(p.dtype == dtype for p in ours16.parameters())
    toks = random_tokens(facts.vocab_size, 13, seed=1)
    ref = step_logits(ours32, PagedCache(facts), [("s", 0, toks)])[0]
    got = step_logits(ours16, PagedCache(facts, dtype=dtype), [("s", 0, toks)])[0]
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()
