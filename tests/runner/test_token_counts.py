"""The penalties' record of a row's tokens in its two forms (runner/token_counts.py): per-id counts, or the
row's token ids when the model length is shorter than the vocabulary. Same logits, same tokens, same counts."""

from __future__ import annotations

import random

import pytest
import torch

from kvfit.planning import persistent_batch_bytes, token_history_applies, token_record_row_bytes
from kvfit.runner.logits_processing import PROMPT_BIT, RowExtras
from kvfit.runner.sampling_state import SamplingState
from kvfit.runner.token_counts import DenseCounts, TokenHistory
from kvfit.sampling_params import SamplingParams

V, ROWS, MAX_LEN = 96, 6, 40


def test_the_smaller_form_is_chosen():
    assert not token_history_applies(V, None)                    # no model length given: counts per id
    assert token_history_applies(V, MAX_LEN)
    assert not token_history_applies(V, V)                       # as long as the vocabulary: counts per id
    assert token_record_row_bytes(151_936, 2048) == 4 * 2049 + 16
    assert token_record_row_bytes(128_256, 131_072) == 4 * 128_256
    # qwen3-0.6b's shape at 256 rows and 2,048 tokens: 155.6 MB of counts become 2.1 MB of token ids
    assert persistent_batch_bytes(256, 128, 151_936) - persistent_batch_bytes(256, 128, 151_936, max_row_tokens=2048) \
        == 256 * (4 * 151_936 - 4 * 2049 - 16)


def _params(rng: random.Random) -> SamplingParams:
    kind = rng.randrange(4)
    if kind == 0:
        return SamplingParams(temperature=0)
    if kind == 1:
        return SamplingParams(temperature=0, repetition_penalty=rng.choice([1.3, 0.8]))
    if kind == 2:
        return SamplingParams(seed=rng.randrange(100), frequency_penalty=rng.uniform(-1, 1),
                              presence_penalty=rng.uniform(-1, 1))
    return SamplingParams(seed=rng.randrange(100), repetition_penalty=1.5, frequency_penalty=0.7, top_k=5)


@pytest.mark.parametrize("seed", range(4))
def test_both_forms_sample_the_same_tokens_and_hold_the_same_counts(seed):
    """Rows set (some resumed with outputs, some with prompts a repetition penalty reads), cleared and taken
    again; tokens dropped (counted False) and non-finite rows; chunked sampling: the two forms agree."""
    rng = random.Random(seed)
    dense = SamplingState(ROWS, V, torch.device("cpu"))
    history = SamplingState(ROWS, V, torch.device("cpu"), max_row_tokens=MAX_LEN)
    assert isinstance(dense.token_counts, DenseCounts) and isinstance(history.token_counts, TokenHistory)
    live: dict[int, int] = {}                      # row -> tokens it holds (prompt kept + outputs)
    gen = torch.Generator().manual_seed(seed)
    for step in range(30):
        free = [r for r in range(ROWS) if r not in live]
        if free and rng.random() < 0.4:
            rows = rng.sample(free, rng.randint(1, len(free)))
            params = [_params(rng) for _ in rows]
            prompts = [[rng.randrange(V) for _ in range(rng.randint(1, 8))] for _ in rows]
            outputs = [[rng.randrange(V) for _ in range(rng.randint(0, 5))] for _ in rows]
            extras = [RowExtras(prompt_token_ids=p) for p in prompts]
            for state in (dense, history):
                state.set_rows(rows, params, outputs, extras)
            for row, p, prompt, out in zip(rows, params, prompts, outputs):
                live[row] = (len(prompt) if p.repetition_penalty != 1 else 0) + len(out)
        if live and rng.random() < 0.15:
            gone = rng.sample(sorted(live), 1)
            for state in (dense, history):
                state.clear_rows(gone)
            del live[gone[0]]
        rows = [r for r in sorted(live) if live[r] < MAX_LEN]
        if not rows:
            continue
        logits = torch.randn(len(rows), V, generator=gen) * 3
        if rng.random() < 0.2:
            logits[rng.randrange(len(rows)), 3] = float("nan")
        counted = torch.tensor([rng.random() < 0.85 for _ in rows])
        rows_d, num_generated = torch.tensor(rows), torch.full((len(rows),), step)
        got = [state.sample(logits.clone(), rows_d, rows, num_generated, counted).tolist()
               for state in (dense, history)]
        assert got[0] == got[1], f"step {step}"
        finite = torch.isfinite(logits).all(dim=-1)
        for row, keep in zip(rows, (counted & finite).tolist()):
            live[row] += keep
    assert torch.equal(dense.output_token_counts, history.output_token_counts)


def test_history_counts_outputs_and_marks_each_prompt_token_once():
    state = TokenHistory(3, 10, 12, torch.device("cpu"))
    state.set_rows([2, 0], [[4, 4, 7], []], [[1, 4], [5, 5, 5]], lambda values, dtype: torch.tensor(values,
                                                                                                 dtype=dtype))
    state.add(torch.tensor([9, 4]), torch.tensor([2, 1]), torch.tensor([True, False]))
    counts = state.gather(torch.tensor([2, 0, 1]))
    expected = torch.zeros(3, 10, dtype=torch.int32)
    expected[0, 1], expected[0, 4], expected[0, 9] = 1, 1 | PROMPT_BIT, 1
    expected[0, 7] = PROMPT_BIT
    expected[1, 5] = 3
    assert torch.equal(counts, expected)


def test_history_never_writes_past_the_model_length():
    state = TokenHistory(1, 10, 3, torch.device("cpu"))
    state.set_rows([0], [[]], [[1, 2]], lambda values, dtype: torch.tensor(values, dtype=dtype))
    for token in (3, 4, 5):                   # only the first fits; the others go to the spare column
        state.add(torch.tensor([token]), torch.tensor([0]), torch.tensor([True]))
    assert state.length.tolist() == [3]
    assert state.gather(torch.tensor([0]))[0].tolist() == [0, 1, 1, 1, 0, 0, 0, 0, 0, 0]
    with pytest.raises(AssertionError, match="past max_model_len"):
        state.set_rows([0], [[1, 2]], [[3, 4]], lambda values, dtype: torch.tensor(values, dtype=dtype))


def test_history_sampling_makes_no_host_sync(monkeypatch):
    state = SamplingState(4, V, torch.device("cpu"), max_row_tokens=MAX_LEN)
    params = [SamplingParams(temperature=0, repetition_penalty=1.2, frequency_penalty=0.5),
              SamplingParams(seed=1, presence_penalty=0.3), SamplingParams(temperature=0)]
    rows = [3, 0, 2]
    state.set_rows(rows, params, [[1, 1], [], [2]], [RowExtras(prompt_token_ids=[5, 6])] * 3)
    logits, rows_d = torch.randn(3, V), torch.tensor(rows)

    def host_read(*args, **kwargs):
        raise AssertionError("sample() read a tensor on the host")
    for name in ("item", "tolist", "nonzero", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    monkeypatch.setattr(torch, "nonzero", host_read)
    for k in range(3):
        state.sample(logits, rows_d, rows, torch.tensor([k] * 3))
    monkeypatch.undo()
    assert state.output_token_counts.bitwise_and(PROMPT_BIT - 1).sum().item() == 3 + 3 * 3


@torch.inference_mode()
def _hf_repetition_greedy(folder: str, prompts: list[list[int]], penalty: float, num_new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    config = model.generation_config
    config.eos_token_id = None
    model.config.eos_token_id = None
    config.pad_token_id = 0
    config.max_new_tokens, config.do_sample, config.repetition_penalty = num_new, False, penalty
    return [model.generate(torch.tensor([p]), generation_config=config)[0, len(p):].tolist() for p in prompts]


def test_repetition_penalty_matches_transformers_in_both_forms(tmp_path):
    """Greedy with a repetition penalty (prompt and output tokens) equals transformers' generate, with the
    token ids as the record (max_model_len 96 < vocab 320) and with counts per id (max_model_len 512),
    through preemption (resumed rows rebuild their record) and multi-step rounds (dropped tokens)."""
    from kvfit import LLM
    from tiny_models import make_tiny_model
    folder = make_tiny_model(tmp_path, arch="llama", seed=3)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(5, 40, (n,), generator=g).tolist() for n in (5, 23, 11, 30)]   # repeats in the prompt
    expected = _hf_repetition_greedy(folder, prompts, 1.8, 16)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.8)
    for max_len, extra in ((96, dict(num_gpu_blocks_override=30, max_num_seqs=4)), (96, dict(num_scheduler_steps=4)),
                           (512, {})):
        llm = LLM(folder, device="cpu", dtype="float32", block_size=4, max_model_len=max_len,
                  enable_prefix_caching=False, **extra)
        form = type(llm.engine.workers.runner.batch.sampling.token_counts)
        assert form is (TokenHistory if max_len < 320 else DenseCounts)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == expected, (max_len, extra)
        if "num_gpu_blocks_override" in extra:
            assert llm.engine.stats()["preemptions"] > 0
        llm.shutdown()
