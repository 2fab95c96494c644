"""Review of the penalties' record in its token-ids form (runner/token_counts.TokenHistory, commit d065dfa):
the cases where the two forms could part, checked against per-id counts (DenseCounts) on the same inputs.
Seeded sampling is deterministic, so any difference in the counts shows in the tokens."""

from __future__ import annotations

import random

import pytest
import torch

from kvfit import planning
from kvfit.runner import sampling_state
from kvfit.runner.logits_processing import RowExtras
from kvfit.runner.sampling_state import NONFINITE_TOKEN, SamplingState
from kvfit.runner.token_counts import DenseCounts, TokenHistory
from kvfit.sampling_params import SamplingParams

V, MAX_LEN = 64, 20


def _penalised(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=0, frequency_penalty=0.3)          # no prompt kept
    return SamplingParams(seed=i, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2, top_p=0.9)


@pytest.mark.parametrize("seed", range(6))
def test_chunked_sampler_reads_the_same_counts_in_either_form(monkeypatch, seed):
    """Rows filled to max_model_len exactly (prompt + outputs), sampled in chunks of 3 rows, some tokens
    dropped (counted False) and some rows non-finite: the same tokens and counts as per-id counts, and no
    NONFINITE_TOKEN (-1) among the token ids a gather reads."""
    monkeypatch.setattr(planning, "MAX_SAMPLER_LOGITS", 3 * V)
    rng = random.Random(seed)
    rows = [7, 0, 3, 2, 5]
    params = [_penalised(i) for i in range(len(rows))]
    prompts = [[rng.randrange(V) for _ in range(rng.randint(1, 10))] for _ in rows]
    outputs = [[rng.randrange(V) for _ in range(rng.randint(0, MAX_LEN - len(p) - 1))] for p in prompts]
    dense = SamplingState(8, V, torch.device("cpu"))
    history = SamplingState(8, V, torch.device("cpu"), max_row_tokens=MAX_LEN)
    assert isinstance(history.token_counts, TokenHistory)
    for state in (dense, history):
        state.set_rows(rows, params, outputs, [RowExtras(prompt_token_ids=p) for p in prompts])
    num_tokens = [len(p) + len(o) for p, o in zip(prompts, outputs)]       # the request's prompt + outputs
    gen = torch.Generator().manual_seed(seed)
    for step in range(MAX_LEN):
        live = [i for i in range(len(rows)) if num_tokens[i] < MAX_LEN]     # the engine stops a row at max_model_len
        if not live:
            break
        live_rows = [rows[i] for i in live]
        logits = torch.randn(len(live), V, generator=gen) * 3
        if rng.random() < 0.3:
            logits[rng.randrange(len(live)), 1] = float("nan")
        counted = torch.tensor([rng.random() < 0.9 for _ in live])
        got = [state.sample(logits.clone(), torch.tensor(live_rows), live_rows, torch.full((len(live),), step),
                            counted) for state in (dense, history)]
        assert torch.equal(got[0], got[1]), f"step {step}"
        finite = torch.isfinite(logits).all(dim=-1)
        assert torch.equal(got[1] == NONFINITE_TOKEN, ~finite)
        for j, i in enumerate(live):
            num_tokens[i] += int(finite[j] and counted[j])
    assert torch.equal(dense.output_token_counts, history.output_token_counts)
    assert max(num_tokens) == MAX_LEN                                       # a row reached the model length
    assert history.token_counts.ids[:, :MAX_LEN].min().item() >= 0          # -1 never lands where gather reads


def _generate(folder: str, force_dense: bool, monkeypatch, **engine) -> tuple[type, list, int]:
    from kvfit import LLM
    with monkeypatch.context() as m:
        if force_dense:
            m.setattr(sampling_state, "token_history_applies", lambda vocab_size, max_row_tokens: False)
        llm = LLM(folder, device="cpu", dtype="float32", block_size=4, max_model_len=64, enable_prefix_caching=False,
                  **engine)
        try:
            form = type(llm.engine.workers.runner.batch.sampling.token_counts)
            g = torch.Generator().manual_seed(7)
            prompts = [torch.randint(5, 40, (n,), generator=g).tolist() for n in (5, 23, 63, 50, 40)]  # 63: L - 1
            params = SamplingParams(seed=3, max_tokens=40, ignore_eos=True, repetition_penalty=1.4,
                                    frequency_penalty=0.5, presence_penalty=0.3, top_p=0.9, n=2)
            outs = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
            return form, outs, llm.engine.stats()["preemptions"]
        finally:
            llm.shutdown()


@pytest.mark.parametrize("engine", [dict(num_gpu_blocks_override=40, max_num_seqs=4),
                                    dict(async_scheduling=True, num_scheduler_steps=3, num_gpu_blocks_override=40)])
def test_the_engine_samples_the_same_tokens_in_either_form(tmp_path, monkeypatch, engine):
    """Seeded sampling with every penalty (a repetition penalty reads the prompt), a prompt of max_model_len - 1,
    n = 2, through preemption (set_rows with the full prompt and the outputs so far), async scheduling and
    multi-step rounds: the token-ids form gives the tokens of per-id counts."""
    from tiny_models import make_tiny_model
    folder = make_tiny_model(tmp_path, arch="llama", seed=3)
    dense_form, dense, dense_preemptions = _generate(folder, True, monkeypatch, **engine)
    history_form, history, history_preemptions = _generate(folder, False, monkeypatch, **engine)
    assert (dense_form, history_form) == (DenseCounts, TokenHistory)
    assert dense_preemptions == history_preemptions > 0
    assert history == dense


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("max_logits", [1 << 22, 3 * 1000])      # one pass; chunks of 3 rows
def test_gpu_token_history_sampling_makes_no_host_sync(monkeypatch, max_logits):
    """The token-ids form's add and gather (penalised rows, dropped tokens) never wait for the device, and
    count as the CPU does."""
    monkeypatch.setattr(planning, "MAX_SAMPLER_LOGITS", max_logits)
    vocab, rows = 1000, [7, 0, 3, 2, 5]
    params = [SamplingParams(temperature=0, repetition_penalty=1.2, frequency_penalty=0.5),
              SamplingParams(seed=1, presence_penalty=0.3, top_p=0.9), SamplingParams(temperature=0),
              SamplingParams(seed=2, repetition_penalty=1.1), SamplingParams(seed=3, frequency_penalty=0.2)]
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(3)) * 3
    states = {}
    for device in ("cpu", "cuda"):
        state = SamplingState(8, vocab, torch.device(device), max_row_tokens=64)
        assert isinstance(state.token_counts, TokenHistory)
        state.set_rows(rows, params, [[1, 1], [], [2], [5] * 10, []], [RowExtras(prompt_token_ids=range(20))] * 5)
        states[device] = state
    gpu, rows_d = states["cuda"], torch.tensor(rows, device="cuda")
    counted = torch.tensor([True, False, True, True, True])
    logits_d, counted_d, num_generated = logits.cuda(), counted.cuda(), torch.arange(3, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = [gpu.sample(logits_d, rows_d, rows, num_generated[k].expand(5), counted_d) for k in range(3)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cpu = states["cpu"]
    expected = [cpu.sample(logits, torch.tensor(rows), rows, torch.full((5,), k), counted) for k in range(3)]
    assert [t.tolist() for t in tokens] == [t.tolist() for t in expected]
    assert torch.equal(gpu.output_token_counts.cpu(), cpu.output_token_counts)
