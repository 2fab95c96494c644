"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral) give transformers'
logits and tokens.

Tiny random checkpoints built with transformers' own classes and save_pretrained (per-expert
tensors, the Hub layout); loaded through kvfit's real loader into stacked experts. Covers dense
layers among sparse ones (mlp_only_layers, decoder_sparse_step), top-k renormalised or not,
chunked prefill and decode through a paged cache, a checkpoint missing an expert, and tensor
parallel 2 on gloo (each rank a slice of every expert).
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from paged_batch import PagedCache, hf_logits, random_tokens, step_logits
from tp_ranks import rank_main

from kvfit.attention.torch_ref import TorchReferenceBackend
from kvfit.errors import ConfigError
from kvfit.model_facts import load_model_facts
from kvfit.models.loader import load_model
from kvfit.models.moe import SparseMoE
from tiny_models import make_tiny_model

ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory) -> str:
    # layers 0 and 2 sparse, layer 1 dense (mlp_only_layers)
    return make_tiny_model(tmp_path_factory.mktemp("moe"), arch="qwen3_moe", num_layers=3, seed=7,
                           moe={"num_experts": 8, "top_k": 3, "moe_intermediate_size": 24, "mlp_only_layers": [1],
                                "norm_topk_prob": False})


@pytest.fixture(scope="module")
def tiny_qwen3_moe_step2(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("moe"), arch="qwen3_moe", num_layers=2, seed=8,
                           moe={"num_experts": 4, "top_k": 2, "decoder_sparse_step": 2, "norm_topk_prob": True})


@pytest.fixture(scope="module")
def tiny_qwen2_moe(tmp_path_factory) -> str:
    # a shared expert with a sigmoid gate beside 4 routed experts; layer 1 dense
    return make_tiny_model(tmp_path_factory.mktemp("moe"), arch="qwen2_moe", num_layers=2, seed=10,
                           moe={"num_experts": 4, "top_k": 2, "mlp_only_layers": [1]})


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("moe"), arch="mixtral", num_layers=2, seed=9,
                           moe={"num_experts": 4, "top_k": 2, "moe_intermediate_size": 48})


MODELS = ["tiny_qwen3_moe", "tiny_qwen3_moe_step2", "tiny_qwen2_moe", "tiny_mixtral"]


def _load(folder: str):
    from transformers import AutoModelForCausalLM
    facts = load_model_facts(folder)
    ours = load_model(folder, facts, torch.float32, "cpu", TorchReferenceBackend())
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return facts, ours, hf


def test_sparse_and_dense_layers_follow_the_config(tiny_qwen3_moe, tiny_qwen3_moe_step2, tiny_mixtral):
    kinds = {}
    for folder in (tiny_qwen3_moe, tiny_qwen3_moe_step2, tiny_mixtral):
        _, ours, _ = _load(folder)
        kinds[folder] = [isinstance(layer.mlp, SparseMoE) for layer in ours.model.layers]
    assert kinds[tiny_qwen3_moe] == [True, False, True]          # mlp_only_layers [1]
    assert kinds[tiny_qwen3_moe_step2] == [False, True]          # decoder_sparse_step 2
    assert kinds[tiny_mixtral] == [True, True]


@pytest.mark.parametrize("fixture", MODELS)
def test_chunked_prefill_and_decode_match_transformers(fixture, request):
    facts, ours, hf = _load(request.getfixturevalue(fixture))
    a, b = random_tokens(facts.vocab_size, 21, seed=1), random_tokens(facts.vocab_size, 13, seed=2)
    expected_a, expected_b = hf_logits(hf, a), hf_logits(hf, b)
    cache = PagedCache(facts, block_size=4, num_blocks=24, seed=3)
    got_a, got_b = step_logits(ours, cache, [("a", 0, a[:8]), ("b", 0, b[:12])])
    assert torch.allclose(got_a, expected_a[:8], atol=ATOL), (got_a - expected_a[:8]).abs().max()
    assert torch.allclose(got_b, expected_b[:12], atol=ATOL)
    got_a, got_b = step_logits(ours, cache, [("a", 8, a[8:20]), ("b", 12, b[12:13])])
    assert torch.allclose(got_a, expected_a[8:20], atol=ATOL) and torch.allclose(got_b, expected_b[12:13], atol=ATOL)
    (got_a,) = step_logits(ours, cache, [("a", 20, a[20:21])])
    assert torch.allclose(got_a, expected_a[20:21], atol=ATOL)


def test_a_missing_expert_names_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file
    folder = make_tiny_model(tmp_path, arch="mixtral", num_layers=1, moe={"num_experts": 4})
    path = f"{folder}/model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.0.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    facts = load_model_facts(folder)
    with pytest.raises(ConfigError, match=r"missing tensor model\.layers\.0\.block_sparse_moe\.experts\.2\.w3\.weight"):
        load_model(folder, facts, torch.float32, "cpu", TorchReferenceBackend())


def test_an_expert_of_the_wrong_shape_is_a_config_error(tmp_path):
    from safetensors.torch import load_file, save_file
    folder = make_tiny_model(tmp_path, arch="qwen3_moe", num_layers=1, moe={"num_experts": 4})
    path = f"{folder}/model.safetensors"
    tensors = load_file(path)
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="expert down projection has shape"):
        load_model(folder, load_model_facts(folder), torch.float32, "cpu", TorchReferenceBackend())


def test_transformers_stacked_layout_loads_the_same(tmp_path, tiny_qwen3_moe):
    """transformers 5 keeps experts stacked in memory (gate_up_proj [E, 2I, H], down_proj [E, H, I]):
    a checkpoint written that way loads to the same model."""
    from safetensors.torch import load_file, save_file
    import shutil
    folder = str(tmp_path / "stacked")
    shutil.copytree(tiny_qwen3_moe, folder)
    tensors = load_file(f"{folder}/model.safetensors")
    facts = load_model_facts(folder)
    num_experts = 8
    for layer in (0, 2):
        pre = f"model.layers.{layer}.mlp.experts"
        gate = [tensors.pop(f"{pre}.{e}.gate_proj.weight") for e in range(num_experts)]
        up = [tensors.pop(f"{pre}.{e}.up_proj.weight") for e in range(num_experts)]
        down = [tensors.pop(f"{pre}.{e}.down_proj.weight") for e in range(num_experts)]
        tensors[f"{pre}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        tensors[f"{pre}.down_proj"] = torch.stack(down)
    save_file(tensors, f"{folder}/model.safetensors", metadata={"format": "pt"})
    ours = load_model(folder, facts, torch.float32, "cpu", TorchReferenceBackend())
    ref = load_model(tiny_qwen3_moe, facts, torch.float32, "cpu", TorchReferenceBackend())
    for (name, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), name


def test_an_expert_split_that_does_not_divide_is_a_config_error(tiny_mixtral):
    from kvfit.models.moe import MoECausalLM
    facts = load_model_facts(tiny_mixtral)          # 48 expert channels
    with pytest.raises(ConfigError, match=r"expert MLP channels"):
        MoECausalLM(facts, torch.float32, "cpu", TorchReferenceBackend(), tp_rank=0, tp_size=5)


def test_two_ranks_match_transformers(tmp_path, tiny_qwen3_moe, tiny_qwen2_moe, tiny_mixtral):
    from transformers import AutoModelForCausalLM
    folders = [tiny_qwen3_moe, tiny_qwen2_moe, tiny_mixtral]
    tokens = random_tokens(load_model_facts(tiny_mixtral).vocab_size, 12, seed=4)
    out_file = str(tmp_path / "logits.pt")
    mp.spawn(rank_main, args=(2, str(tmp_path / "init"), folders, tokens, 9, out_file), nprocs=2, join=True)
    results = torch.load(out_file)
    for folder in folders:
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        expected = hf_logits(hf, tokens)
        assert torch.allclose(results[folder], expected, atol=ATOL), (folder, (results[folder] - expected).abs().max())
