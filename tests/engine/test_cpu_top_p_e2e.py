"""Top-p on the CPU end to end: a model whose vocabulary is large enough for the CPU's cut among each row's largest
logits (runner/row_ops.py) samples, seeded, exactly the tokens the whole-row sort gives; every sampled token lies in
the nucleus of transformers' logits."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_model

from kvfit import LLM, SamplingParams
from kvfit.runner import row_ops

VOCAB = 3 * row_ops.CPU_TOP_P_CANDIDATES            # past the cut's 2x guard
KW = dict(device="cpu", dtype="float32", block_size=4, max_model_len=64, kv_cache_memory="16MiB")
PROMPTS = [[5, 9, 23, 40, 7, 7, 12], [300, 301, 199, 250, 17]]


@pytest.fixture(scope="module")
def peaky_model(tmp_path_factory):
    """A tiny Llama whose embedding and LM head are widened to VOCAB ids (past the tokenizer's, as Hub models pad
    theirs), with large weights: next-token distributions that put top_p's mass on a few hundred ids."""
    folder = make_tiny_model(tmp_path_factory.mktemp("vocab"), weight_std=0.6, seed=5)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(0)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        w = tensors[name]                                                   # [V0, hidden]
        extra = torch.randn(VOCAB - w.shape[0], w.shape[1], generator=gen, dtype=w.dtype) * 0.6
        tensors[name] = torch.cat([w, extra])                               # [VOCAB, hidden]
    save_file(tensors, path, metadata={"format": "pt"})
    config_path = os.path.join(folder, "config.json")
    config = json.load(open(config_path))
    config["vocab_size"] = VOCAB
    json.dump(config, open(config_path, "w"), indent=1)
    return folder


def _runs(folder: str) -> list[list[int]]:
    llm = LLM(folder, **KW)
    params = [SamplingParams(temperature=1.0, top_p=p, seed=s, max_tokens=12, ignore_eos=True, logprobs=1,
                             detokenize=False)
              for p in (0.5, 0.9) for s in (1, 2)]
    outs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS for _ in params], params * len(PROMPTS),
                        use_tqdm=False)
    llm.shutdown()
    return [list(out.outputs[0].token_ids) for out in outs]


def test_seeded_top_p_on_the_cpu_equals_the_whole_sort(peaky_model, monkeypatch):
    calls = []
    cut = row_ops._cpu_top_p_thresholds
    monkeypatch.setattr(row_ops, "_cpu_top_p_thresholds", lambda *a: (calls.append(1), cut(*a))[1])
    fast = _runs(peaky_model)
    assert calls, "the CPU's top-p cut did not run"
    monkeypatch.setattr(row_ops, "CPU_TOP_P_CANDIDATES", VOCAB)      # the guard fails: every row sorted whole
    assert _runs(peaky_model) == fast


def test_top_p_tokens_lie_in_transformers_nucleus(peaky_model):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(peaky_model, torch_dtype=torch.float32).eval()
    llm = LLM(peaky_model, **KW)
    params = SamplingParams(temperature=1.0, top_p=0.5, seed=3, max_tokens=8, ignore_eos=True, detokenize=False)
    for ids in PROMPTS:
        tokens = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0].token_ids
        seq = list(ids)
        for token in tokens:
            with torch.inference_mode():
                probs = torch.softmax(hf(torch.tensor([seq])).logits[0, -1].float(), dim=-1)
            ranked = torch.sort(probs, descending=True)
            mass_before = torch.cumsum(ranked.values, dim=0) - ranked.values
            nucleus = set(ranked.indices[mass_before <= 0.5 + 1e-4].tolist())
            assert token in nucleus, (seq, token)
            seq.append(token)
    llm.shutdown()
