"""The command line as a user runs it: `python -m kvfit.cli ...` in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PLAN_KEYS = {"num_blocks", "block_size", "bytes_per_block", "kv_cache_bytes", "available_kv_bytes", "bound_by",
             "limits", "max_model_len", "max_concurrency", "token_capacity", "kv_heads_per_rank",
             "tensor_parallel_size"}


def kvfit(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "kvfit.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_plan_json_has_the_contract_fields():
    out = kvfit("plan", "llama-3.1-8b", "--gpu", "H200", "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert PLAN_KEYS <= set(plan)
    assert set(plan["limits"]) == {"memory", "override", "max_num_blocks", "index_width"}
    assert plan["bound_by"] == "memory"
    assert plan["num_blocks"] == plan["available_kv_bytes"] // plan["bytes_per_block"]
    assert plan["kv_cache_bytes"] == plan["num_blocks"] * plan["bytes_per_block"]
    assert plan["num_blocks"] > 40000        # the clamp this project exists to remove


def test_plan_table_and_override():
    out = kvfit("plan", "qwen3-0.6b", "--device-memory", "80GiB", "--num-gpu-blocks-override", "1000",
                "--max-model-len", "4096")
    assert out.returncode == 0, out.stderr
    assert "bound by override" in out.stdout


@pytest.mark.parametrize("args,needle", [
    (["plan", "llama-3.1-8b", "--gpu-memory-utilization", "0"], "gpu-memory-utilization"),
    (["plan", "llama-3.1-8b", "--block-size", "12"], "block-size"),
    (["plan", "llama-3.1-8b", "--num-gpu-blocks-override", "-1"], "num-gpu-blocks-override"),
    (["plan", "llama-3.1-8b", "--tensor-parallel-size", "3"], "tensor-parallel-size"),
    (["plan", "llama-3.1-8b", "--kv-cache-dtype", "int3"], "kv-cache-dtype"),
    (["plan", "no-such-model"], "unknown model"),
    (["plan", "llama-3.1-8b", "--gpu", "B9000"], "unknown GPU"),
    (["plan", "llama-3.1-8b", "--device-memory", "lots"], "device-memory"),
    (["plan", "llama-3.1-70b", "--gpu", "RTX-4090"], "weights"),
    (["plan", "llama-3.1-8b", "--block-size", "x"], "block-size"),
    (["plan", "/nonexistent/folder"], "no model folder"),
])
def test_bad_input_is_one_line_error(args, needle):
    out = kvfit(*args)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], out.stderr
    assert "Traceback" not in out.stderr


def test_malformed_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    out = kvfit("plan", str(tmp_path))
    assert out.returncode != 0 and out.stderr.startswith("error: ") and "Traceback" not in out.stderr


def test_generate_json_lines(tiny_llama):
    out = kvfit("generate", tiny_llama, "--prompt", "the quick brown fox", "--prompt", "hello",
                "--max-tokens", "5", "--temperature", "0", "--dtype", "float32", "--device", "cpu",
                "--kv-cache-memory", "16MiB", "--max-model-len", "128", "--json")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == ["the quick brown fox", "hello"]
    assert all(len(r["token_ids"]) <= 5 and isinstance(r["text"], str) for r in rows)
    from kvfit import LLM, SamplingParams
    llm = LLM(tiny_llama, device="cpu", dtype="float32", kv_cache_memory="16MiB", max_model_len=128)
    ref = llm.generate(["the quick brown fox", "hello"], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert [r["token_ids"] for r in rows] == [o.outputs[0].token_ids for o in ref]


def test_generate_without_prompts_is_an_error(tiny_llama):
    out = kvfit("generate", tiny_llama, "--device", "cpu")
    assert out.returncode != 0 and out.stderr.startswith("error: ") and "prompt" in out.stderr


def test_demo_preempts_and_frees_every_block():
    out = kvfit("demo", timeout=120)
    assert out.returncode == 0, out.stderr
    assert "RANDOM weights" in out.stdout and "capacity report" in out.stdout
    preempt = next(line for line in out.stdout.splitlines() if line.startswith("preemptions:"))
    assert int(preempt.split()[1]) > 0
    assert "0 used" in out.stdout


def test_generate_token_id_prompts(tiny_llama):
    out = kvfit("generate", tiny_llama, "--prompt-token-ids", "5,6,7", "--max-tokens", "3", "--temperature", "0",
                "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "16MiB", "--max-model-len", "64",
                "--ignore-eos", "--json")
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)
    assert row["prompt"] == [5, 6, 7] and len(row["token_ids"]) == 3
    bad = kvfit("generate", tiny_llama, "--prompt-token-ids", "5,x", "--device", "cpu")
    assert bad.returncode != 0 and bad.stderr.startswith("error: ") and "prompt-token-ids" in bad.stderr


def test_generate_takes_sampling_defaults_from_the_generation_config(tiny_llama, tmp_path):
    """generate's sampling flags left out: the folder's generation_config.json (a folder given by
    --generation-config here), else vLLM's; a flag given wins."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0, "repetition_penalty": 2.0,
                                                                 "max_new_tokens": 4}))
    common = ("generate", tiny_llama, "--prompt-token-ids", "5,6,7", "--dtype", "float32", "--device", "cpu",
              "--kv-cache-memory", "16MiB", "--max-model-len", "64", "--ignore-eos", "--json")
    out = kvfit(*common, "--generation-config", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "default sampling params from" in out.stderr and "repetition_penalty=2.0" in out.stderr
    tuned = json.loads(out.stdout)["token_ids"]
    flags = kvfit(*common, "--temperature", "0", "--max-tokens", "4", "--generation-config", "vllm")
    assert flags.returncode == 0, flags.stderr
    greedy = json.loads(flags.stdout)["token_ids"]
    from kvfit import LLM, SamplingParams
    llm = LLM(tiny_llama, dtype="float32", device="cpu", kv_cache_memory="16MiB", max_model_len=64)
    try:
        ref = [llm.generate([[5, 6, 7]], SamplingParams(ignore_eos=True, max_tokens=4, temperature=0, **penalty),
                            use_tqdm=False)[0].outputs[0].token_ids for penalty in ({"repetition_penalty": 2.0}, {})]
    finally:
        llm.shutdown()
    assert [tuned, greedy] == ref and tuned != greedy       # the file's penalty was applied


@pytest.mark.parametrize("flag", ["--async-scheduling", "--no-async-scheduling"])
def test_generate_takes_the_async_scheduling_flags_with_the_same_tokens(tiny_llama, flag):
    out = kvfit("generate", tiny_llama, "--prompt", "the quick brown fox", "--max-tokens", "6", "--temperature", "0",
                "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "16MiB", "--max-model-len", "128",
                "--num-scheduler-steps", "2", flag, "--json")
    assert out.returncode == 0, out.stderr
    from kvfit import LLM, SamplingParams
    llm = LLM(tiny_llama, device="cpu", dtype="float32", kv_cache_memory="16MiB", max_model_len=128,
              async_scheduling=False)
    ref = llm.generate(["the quick brown fox"], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert json.loads(out.stdout.splitlines()[0])["token_ids"] == ref[0].outputs[0].token_ids


def test_async_scheduling_with_tensor_parallelism_is_a_one_line_error(tiny_llama):
    out = kvfit("generate", tiny_llama, "--prompt", "hi", "--device", "cpu", "--tensor-parallel-size", "2",
                "--num-scheduler-steps", "1", "--async-scheduling")
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "--async-scheduling needs --tensor-parallel-size 1" in out.stderr
