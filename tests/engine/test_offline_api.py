"""The offline API's inputs: misuse is a one-line KvfitError, never a misreading; generate is thread-safe."""

from __future__ import annotations

import pathlib
import threading
import time

import pytest

from kvfit import LLM, SamplingParams
from kvfit.errors import ConfigError, RequestError

KW = dict(device="cpu", dtype="float32", kv_cache_memory="4MiB", block_size=4, max_model_len=64)
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(pathlib.Path(tiny_llama), **KW)          # a Path is a model path


@pytest.mark.parametrize("prompts", [b"hello", None, 5, [b"hi"], [[1, "2"]], [None], [[True, 2]]])
def test_prompts_that_are_not_text_or_token_ids_are_request_errors(llm, prompts):
    with pytest.raises(RequestError, match="prompt") as info:
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert "\n" not in str(info.value)
    assert llm.engine.stats()["kv_blocks_used"] == 0 and not llm.engine.has_unfinished()


@pytest.mark.parametrize("kwargs, match", [(dict(stop={"a": 1}), "stop must be"),
                                           (dict(ignore_eos="no"), "ignore_eos must be true or false"),
                                           (dict(stop_token_ids="5"), "stop_token_ids")])
def test_sampling_params_of_the_wrong_type_are_refused(kwargs, match):
    with pytest.raises(RequestError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(enable_prefix_caching="no"), dict(enforce_eager=1)])
def test_boolean_settings_must_be_booleans(tiny_llama, kwargs):
    with pytest.raises(ConfigError, match="must be true or false"):
        LLM(tiny_llama, **KW, **kwargs)


def test_generate_from_several_threads_gives_each_its_own_outputs(llm):
    prompts = [[5 + i, 6, 7] for i in range(6)]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    results, errors = {}, []

    def worker(i):
        try:
            results[i] = [o.outputs[0].token_ids for o in llm.generate(prompts[i::3], GREEDY, use_tqdm=False)]
        except Exception as exc:      # noqa: BLE001 - reported below
            errors.append(exc)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    for i in range(3):
        assert results[i] == expected[i::3]
    assert llm.engine.stats()["kv_blocks_used"] == 0


def test_a_seed_past_torchs_range_is_a_config_error(tiny_llama):
    with pytest.raises(ConfigError, match="--seed must be at most 2"):
        LLM(tiny_llama, seed=2**64, **KW)


# cache_salt (vLLM's prefix-cache isolation) in a prompt dict ----------------------------------------
SALT_PROMPT = list(range(1, 30))       # 7 full blocks of 4 + 1 token


def _cached_tokens(llm, prompt) -> int:
    return llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens


def test_cache_salt_shares_the_prefix_cache_only_with_the_same_salt(tiny_llama):
    llm = LLM(tiny_llama, **KW)       # its own cache: no other test's blocks
    salted = {"prompt_token_ids": SALT_PROMPT, "cache_salt": "tenant-a"}
    assert _cached_tokens(llm, salted) == 0
    assert _cached_tokens(llm, salted) == 28                             # same salt: a hit
    assert _cached_tokens(llm, {**salted, "cache_salt": "tenant-b"}) == 0   # another salt: none
    assert _cached_tokens(llm, {"prompt_token_ids": SALT_PROMPT}) == 0      # no salt: none
    assert _cached_tokens(llm, SALT_PROMPT) == 28                        # unsalted prompts share as before
    text = llm.get_tokenizer().decode(SALT_PROMPT)
    assert _cached_tokens(llm, {"prompt": text, "cache_salt": "t"}) == 0
    out = llm.generate({"prompt": text, "cache_salt": "t"}, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens > 0
    # the salt changes what is shared, never the output
    assert out.outputs[0].token_ids == llm.generate(text, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm.shutdown()


def test_prompts_submitted_together_share_their_prefix_in_the_first_step(tiny_llama):
    # vLLM caches blocks when it schedules them: the second prompt finds the first one's 7 full blocks in
    # the very step that computes them, and both give what each gives alone
    llm = LLM(tiny_llama, **KW)
    prompts = [SALT_PROMPT, SALT_PROMPT[:-1] + [77]]
    alone = []
    for prompt in prompts:
        alone.append(llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
        assert llm.reset_prefix_cache()
    together = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in together] == [0, 28]
    assert [o.outputs[0].token_ids for o in together] == alone
    llm.shutdown()


def test_a_step_that_fails_leaves_no_cached_block_without_its_kv(tiny_llama):
    # blocks are cached when their step is scheduled; a step that raises (a device error, an interrupt)
    # never wrote them, so their hashes go with it and the next request computes the prompt again
    llm = LLM(tiny_llama, **KW)
    want = llm.generate(SALT_PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.reset_prefix_cache()
    model = llm.engine.workers.runner.model

    def fail(*args, **kwargs):
        raise RuntimeError("simulated device error")
    model.forward = fail
    with pytest.raises(RuntimeError, match="simulated"):
        llm.generate([SALT_PROMPT, SALT_PROMPT[:-1] + [77]], GREEDY, use_tqdm=False)
    del model.forward
    stats = llm.engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_cached"] == 0
    got = llm.generate(SALT_PROMPT, GREEDY, use_tqdm=False)[0]
    assert got.num_cached_tokens == 0 and got.outputs[0].token_ids == want
    llm.engine.scheduler.kv.check_invariants()
    llm.shutdown()


def test_reset_prefix_cache_forgets_cached_prefixes_and_refuses_while_requests_hold_blocks(tiny_llama):
    llm = LLM(tiny_llama, **KW)       # its own cache: no other test's blocks
    first = llm.generate(SALT_PROMPT, GREEDY, use_tqdm=False)[0]
    assert _cached_tokens(llm, SALT_PROMPT) == 28
    assert llm.reset_prefix_cache() is True
    again = llm.generate(SALT_PROMPT, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0                        # computed afresh, with the same tokens
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert _cached_tokens(llm, SALT_PROMPT) == 28              # and cached again
    request_id = llm.engine.add_request(SALT_PROMPT, GREEDY)
    llm.engine.step()
    assert llm.reset_prefix_cache() is False                   # vLLM's: not while blocks are held
    llm.engine.abort(request_id)
    assert llm.reset_prefix_cache() is True
    with pytest.raises(ValueError, match="reset_running_requests and reset_connector are not supported"):
        llm.reset_prefix_cache(reset_running_requests=True)
    assert llm.engine.stats()["kv_blocks_used"] == 0
    llm.shutdown()


@pytest.mark.parametrize("salt", ["", 5, ["a"], b"a"])
def test_a_cache_salt_that_is_not_a_non_empty_string_is_a_request_error(llm, salt):
    with pytest.raises(RequestError, match="cache_salt must be a non-empty string") as info:
        llm.generate({"prompt": "hi", "cache_salt": salt}, GREEDY, use_tqdm=False)
    assert info.value.param == "cache_salt" and "\n" not in str(info.value)
    with pytest.raises(RequestError, match="cache_salt"):
        llm.engine.add_request([1, 2], GREEDY, cache_salt="")


def test_shutdown_gives_the_memory_back_and_later_calls_are_a_clear_error(tiny_llama):
    from kvfit.errors import KvfitError
    llm = LLM(tiny_llama, device="cpu", dtype="float32", max_model_len=64, kv_cache_memory="4MiB")
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    runner = llm.engine.workers.runner
    llm.shutdown()
    assert runner.model is None and runner.kv_caches == [] and runner.batch is None
    with pytest.raises(KvfitError, match="shut down"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.shutdown()                                   # twice is fine


def test_an_n_past_the_caches_token_capacity_is_refused_at_once(llm):
    """n = 2**63 - 1 built children one by one before anything ran (memory grew until the OOM killer)."""
    start = time.monotonic()
    with pytest.raises(RequestError, match=r"n=9223372036854775807 samples is more than the KV cache's token"):
        llm.generate(["Hello"], SamplingParams(n=2 ** 63 - 1, max_tokens=1), use_tqdm=False)
    assert time.monotonic() - start < 5
