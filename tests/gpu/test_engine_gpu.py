"""The engine on a GPU end to end: Triton kernels, CUDA graphs and multi-step decoding give the
greedy tokens of transformers (fp32) and of single-step decoding, token for token.

Run: python -m pytest tests/gpu/test_engine_gpu.py -q
"""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("triton")

from kvfit import LLM, SamplingParams  # noqa: E402

PROMPTS = [[5, 6, 7], list(range(9, 40)), [30] * 20, [40, 41], list(range(100, 170))]
MAX_TOKENS = [24, 5, 17, 30, 11]


@torch.inference_mode()
def _hf_greedy(folder, prompts, max_tokens):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    config = model.generation_config
    config.eos_token_id = None
    model.config.eos_token_id = None
    config.pad_token_id, config.do_sample = 0, False
    out = []
    for p, n in zip(prompts, max_tokens):
        ids = torch.tensor([p])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             generation_config=config)
        out.append(gen[0, len(p):].tolist())
    return out


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory) -> str:
    from tiny_models import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("moe"), arch="qwen3_moe", seed=11,
                           moe={"num_experts": 8, "top_k": 2, "norm_topk_prob": True})


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory) -> str:
    from tiny_models import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("moe"), arch="mixtral", seed=12,
                           moe={"num_experts": 4, "top_k": 2, "moe_intermediate_size": 48})


@pytest.fixture(scope="module")
def tiny_llama_yarn(tmp_path_factory) -> str:
    """YaRN with an attention factor: every GPU attention kernel (prefill, decode, cascade) must take the
    layer's softmax scale, which here is not head_dim ** -0.5."""
    from tiny_models import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("yarn"), arch="llama", seed=13,
                           rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                         "mscale": 0.707, "mscale_all_dim": 1.0},
                           max_position_embeddings=256)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3", "tiny_qwen3_moe", "tiny_mixtral", "tiny_llama_yarn"])
def test_cuda_graphs_and_multi_step_match_transformers(fixture, request):
    folder = request.getfixturevalue(fixture)
    expected = _hf_greedy(folder, PROMPTS, MAX_TOKENS)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    sampled = [SamplingParams(temperature=0.9, top_p=0.95, seed=7 + i, max_tokens=n, ignore_eos=True)
               for i, n in enumerate(MAX_TOKENS)]
    runs = {}
    for steps in (1, 4, 8):
        llm = LLM(folder, device="cuda", dtype="float32", kv_cache_memory="512MiB", max_model_len=256,
                  max_num_seqs=8, num_scheduler_steps=steps)
        assert llm.engine.workers.runner.graphs is not None
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        assert got == expected, f"{fixture}: {steps} scheduler steps differ from transformers"
        runs[steps] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sampled, use_tqdm=False)]
        assert llm.engine.stats()["kv_blocks_used"] == 0
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()
    assert runs[4] == runs[1] and runs[8] == runs[1], "seeded sampling depends on the scheduler steps"


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3_moe"])
def test_steps_with_prefill_chunks_replay_graphs_and_match_transformers(fixture, request, monkeypatch):
    # a 64-token step budget chunks the long prompts, so most steps mix chunks and decodes: they replay the
    # mixed-step graphs (padded to a bucket, the tile-mapped prefill grid); tokens equal transformers', and
    # equal the eager engine's logprobs closely
    folder = request.getfixturevalue(fixture)
    # every candidate bucket kept whatever this machine's timings: which buckets pay is the start-up's call,
    # the graphs' outputs are what this test checks
    import kvfit.runner.cuda_graphs as cuda_graphs
    monkeypatch.setattr(cuda_graphs, "MIXED_GRAPH_GAIN", float("inf"))
    prompts = PROMPTS + [list(range(200, 300)), [7] * 90]
    max_tokens = MAX_TOKENS + [9, 13]
    expected = _hf_greedy(folder, prompts, max_tokens)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in max_tokens]
    results = {}
    for eager in (False, True):
        llm = LLM(folder, device="cuda", dtype="float32", kv_cache_memory="512MiB", max_model_len=256,
                  max_num_seqs=8, max_num_batched_tokens=64, enforce_eager=eager)
        runner = llm.engine.workers.runner
        replayed = []
        if not eager:
            mixed = runner.mixed_graphs
            assert mixed is not None and mixed.buckets, "no mixed-step graphs captured"
            replay = mixed.replay
            mixed.replay = lambda *args: replayed.append(replay(*args)) or replayed[-1]
        outs = llm.generate(prompts, params, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outs]
        assert got == expected, f"{fixture}, eager {eager}: tokens differ from transformers"
        results[eager] = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                          for o in outs]
        if not eager:
            assert sum(h is not None for h in replayed) >= 3, "the chunked steps did not replay mixed graphs"
        assert llm.engine.stats()["kv_blocks_used"] == 0
        llm.shutdown()
        del llm, runner
        replay = mixed = None
        gc.collect()
        torch.cuda.empty_cache()
    for a, b in zip(results[False], results[True]):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-3


@pytest.mark.parametrize("mode", ["graphs-1-step", "graphs-8-steps", "eager"])
def test_cascade_decode_matches_transformers(tiny_qwen3, mode, monkeypatch):
    # ten requests share a 300-token prompt prefix (prefix caching): decode attends it once for all of them
    # (the cascade graphs, or the eager kernels); tokens equal transformers' and the engine's without cascade.
    # The tiny model's 512 positions are too few for the rule's sequences x tokens: lifted here
    import kvfit.attention.triton_backend as triton_backend
    monkeypatch.setattr(triton_backend, "CASCADE_MIN_SHARED_READS", 0)
    shared = [1 + i % 290 for i in range(300)]
    prompts = [shared + [300 + i] * (1 + i % 3) for i in range(10)]
    max_tokens = [6 + i for i in range(10)]
    expected = _hf_greedy(tiny_qwen3, prompts, max_tokens)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    kw = {"num_scheduler_steps": 8 if mode == "graphs-8-steps" else 1, "enforce_eager": mode == "eager"}
    for cascade in (True, False):
        llm = LLM(tiny_qwen3, device="cuda", dtype="float32", kv_cache_memory="512MiB", max_model_len=512,
                  max_num_seqs=16, enable_prefix_caching=True, disable_cascade_attn=not cascade, **kw)
        runner = llm.engine.workers.runner
        seen = []
        if mode == "eager":
            assert runner.graphs is None
            attend = runner.backend.attend
            runner.backend.attend = lambda q, k, v, meta, scale, *rest, **kw: (
                seen.append(meta.prefix_len is not None), attend(q, k, v, meta, scale, *rest, **kw))[1]
        else:
            assert bool(runner.graphs.cascade_graphs) is cascade
            graphs = runner.graphs
            replay = graphs.replay      # a step replays its bucket's cascade graph when it has a prefix

            def replay_seen(*args):
                seen.append(args[-1] is not None and graphs.bucket_for(args[0].shape[0]) in graphs.cascade_graphs)
                return replay(*args)
            graphs.replay = replay_seen
        llm.generate([shared + [299]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # cache it
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == expected, f"{mode}, cascade {cascade}: tokens differ from transformers"
        assert any(seen) is cascade, f"{mode}: cascade {'not ' if cascade else ''}used"
        assert llm.engine.stats()["kv_blocks_used"] == 0
        llm.shutdown()
        del llm, runner
        replay = attend = graphs = replay_seen = None
        gc.collect()        # the wrappers above are reference cycles that hold the engine's KV cache
        torch.cuda.empty_cache()
