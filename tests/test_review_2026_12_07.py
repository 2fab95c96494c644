"""Review of 2026-12-07's changes: --quantization on a checkpoint that quantizes only the KV cache, errors of
hf_quant_config.json naming that file, a chat reply's role with tools, and a SIGTERM to the whole process group
(systemd's stop) reaching prepare workers and tensor-parallel ranks, not only the engine core."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "server"))

from kvfit.errors import ConfigError  # noqa: E402
from kvfit.model_facts import facts_from_config, load_model_facts, with_quantization  # noqa: E402

KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def _config(tiny_llama, **extra) -> dict:
    with open(os.path.join(tiny_llama, "config.json")) as fh:
        return {**json.load(fh), **extra}


@pytest.mark.parametrize("quant, method", [
    ({"quant_method": "compressed-tensors", "config_groups": {}, "kv_cache_scheme": KV_SCHEME}, "compressed-tensors"),
    ({"quant_method": "modelopt", "quantization": {"quant_algo": None, "kv_cache_quant_algo": "FP8"}}, "modelopt")])
def test_quantization_naming_a_kv_cache_only_checkpoints_method_is_served(tiny_llama, quant, method):
    """It was refused ('config.json declares none'), though config.json declares that very method; vLLM runs it.
    fp8 (or another method) contradicts the checkpoint's, as on an FP8 checkpoint: an error, not online FP8."""
    facts = facts_from_config(_config(tiny_llama, quantization_config=quant))
    named = with_quantization(facts, method)
    assert named.quantization is None and named.kv_cache_scales and named.weight_dtype_bytes == facts.weight_dtype_bytes
    for other in ("fp8", "modelopt" if method != "modelopt" else "compressed-tensors"):
        with pytest.raises(ConfigError, match=f"does not match the checkpoint's quant_method '{method}'") as info:
            with_quantization(facts, other)
        assert "\n" not in str(info.value)


def test_an_unknown_quantization_lists_every_value_it_takes(tiny_llama):
    facts = facts_from_config(_config(tiny_llama))
    with pytest.raises(ConfigError, match="use one of fp8, compressed-tensors, modelopt"):
        with_quantization(facts, "awq")


@pytest.mark.parametrize("quantization, needle", [
    ({"quant_algo": "NVFP4"}, "quant_algo 'NVFP4' is not supported"),
    ({"quant_algo": "FP8", "kv_cache_quant_algo": "NVFP4"}, "kv_cache_quant_algo 'NVFP4' is not supported"),
    ({"quant_algo": "FP8", "exclude_modules": "lm_head"}, "'exclude_modules' must be a list")])
def test_an_hf_quant_config_json_kvfit_cannot_run_is_named_as_that_file(tiny_llama, tmp_path, quantization, needle):
    """The error said 'config.json quantization_config: ...' for a config.json that has no quantization_config:
    the user was sent to the wrong file."""
    folder = tmp_path / "modelopt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_config(tiny_llama)))
    (folder / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"},
                                                             "quantization": quantization}))
    with pytest.raises(ConfigError) as info:
        load_model_facts(str(folder))
    message = str(info.value)
    assert message.startswith(f"{folder / 'hf_quant_config.json'} quantization: ") and needle in message
    assert "quantization_config" not in message and "\n" not in message


def test_a_reply_with_tools_takes_the_requests_role_too():
    """Without add_generation_prompt the reply continues the last message in its role: the stream's first chunk
    said 'user' and the full response of the same request 'assistant' once tools were given."""
    from kvfit.engine.output import CompletionOutput, RequestOutput
    from kvfit.sampling_params import SamplingParams
    from kvfit.server.params import GenerateInput
    from kvfit.server.responses import ResponseBuilder
    from kvfit.server.tools import ToolPlan

    class Chars:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

        def token_text(self, token_id):
            return chr(token_id)

    text = 'ok <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    for role in ("user", "assistant"):
        inp = GenerateInput([1], SamplingParams(), True, False, False, tools=ToolPlan("auto", True, parser="hermes"),
                            role=role)
        builder = ResponseBuilder(True, "m", inp, Chars())
        sample = CompletionOutput(0, text, [ord(c) for c in text], None, None, "stop", None)
        message = builder.full(RequestOutput("r", "x", [1], None, [sample], True), 1)["choices"][0]["message"]
        assert message["role"] == role and message["tool_calls"][0]["function"]["name"] == "f"
        assert builder.role_chunks(1)[0]["choices"][0]["delta"]["role"] == role


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_prepare_worker_outlives_a_sigterm_to_the_process_group(tiny_llama):
    """systemd's stop signals every process of the server: a worker preparing a chat (a slow template's, now
    any chat's past 20 ms) died of it and its request was a 500 with a traceback while the server drained."""
    from kvfit.server.prepare import PrepareContext
    from kvfit.server.prepare_pool import PreparePool
    from kvfit.server.protocol import ChatCompletionRequest
    pool = PreparePool(tiny_llama, PrepareContext(("tiny",), None, 200_000, 128), num_processes=1)
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}).encode()
    try:
        first = asyncio.run(pool.prepare(body, ChatCompletionRequest))
        [pid] = pool.worker_pids()
        os.kill(pid, signal.SIGTERM)
        time.sleep(0.5)
        assert _alive(pid)
        assert asyncio.run(pool.prepare(body, ChatCompletionRequest)).prompt_ids == first.prompt_ids
        assert pool.worker_pids() == [pid]
    finally:
        pool.shutdown()
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)


def test_a_tensor_parallel_rank_outlives_a_sigterm_to_the_process_group(tiny_llama):
    """The engine core ignores a process group's SIGTERM so the server drains in order; its ranks did not: rank 1
    died of it ('rank 1 was killed by signal 15'), the engine was dead and kvfit serve exited 1."""
    from kvfit import LLM, SamplingParams
    llm = LLM(tiny_llama, device="cpu", dtype="float32", max_model_len=64, num_gpu_blocks_override=16,
              tensor_parallel_size=2)
    try:
        params = SamplingParams(temperature=0, max_tokens=3)
        want = llm.generate(["hello"], params, use_tqdm=False)[0].outputs[0].token_ids
        ranks = llm.engine.workers.pids            # ranks 1..N-1
        assert len(ranks) == 1
        for pid in ranks:
            os.kill(pid, signal.SIGTERM)
        time.sleep(0.5)
        assert all(_alive(pid) for pid in ranks)
        assert llm.generate(["hello"], params, use_tqdm=False)[0].outputs[0].token_ids == want
    finally:
        started = time.monotonic()
        llm.shutdown()
    assert time.monotonic() - started < 5 and not any(_alive(pid) for pid in ranks)
