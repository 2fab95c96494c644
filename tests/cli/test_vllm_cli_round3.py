"""vLLM's command-line habits the CLI pass found (against vLLM 0.26's arg_utils and FlexibleArgumentParser): flag
names with underscores, human-readable --max-num-batched-tokens, --config refused by name (it was read as
--config-format), VLLM_API_KEY read where KVFIT_API_KEY is not set, --override-generation-config's max_new_tokens a
cap on every request, and an allocation failure a one-line error, not a traceback."""

from __future__ import annotations

import json

import pytest

from kvfit.cli import main, out_of_memory
from kvfit.server.launch import resolve_api_key
from kvfit.server.params import RequestDefaults


def test_underscores_and_human_readable_batched_tokens(capsys):
    assert main(["plan", "llama-3.1-8b", "--gpu", "H100-80GB", "--max_num_seqs", "8", "--max-num-batched-tokens",
                 "8K", "--max_model_len=4k", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["max_model_len"] == 4000                 # --max_model_len=4k read as --max-model-len 4k
    with pytest.raises(SystemExit) as info:                 # argparse's one-line usage error
        main(["plan", "llama-3.1-8b", "--gpu", "H100-80GB", "--max-num-batched-tokens", "lots"])
    assert info.value.code == 2 and "expected an integer like 4096, 32k or 32K" in capsys.readouterr().err


def test_config_yaml_is_refused_by_name(capsys):
    for args in (["--config", "flags.yaml"], ["--config=flags.yaml"]):
        assert main(["plan", "llama-3.1-8b", "--gpu", "H100-80GB", *args]) == 2
        err = capsys.readouterr().err
        assert "--config (a YAML file of flags) is not read by kvfit" in err and err.count("\n") == 1


def test_vllm_api_key_is_read_after_kvfits():
    assert resolve_api_key(None, None, {"VLLM_API_KEY": "k1"}) == "k1"
    assert resolve_api_key(None, None, {"VLLM_API_KEY": "k1", "KVFIT_API_KEY": "k2"}) == "k2"
    assert resolve_api_key("k3", None, {"VLLM_API_KEY": "k1"}) == "k3"
    assert resolve_api_key(None, None, {}) is None


def test_override_max_new_tokens_caps_every_request():
    defaults = RequestDefaults.from_config({"max_tokens": 3}, "auto", override_max_tokens=3)
    assert defaults.max_tokens(10) == 3 and defaults.max_tokens(2) == 2 and defaults.max_tokens(None) == 3
    assert RequestDefaults.from_config({}, "vllm").max_tokens(10) == 10


def test_an_allocation_failure_is_named():
    exc = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 128000000000 bytes.")
    assert "can't allocate memory" in out_of_memory(exc) and out_of_memory(MemoryError()) == "MemoryError"
    assert out_of_memory(RuntimeError("shape mismatch")) == ""


def test_short_parallel_flags_and_no_enable_log_requests(capsys):
    from kvfit.cli import parse_args
    parse_args(["generate", "llama-3.1-8b", "-pp", "1", "-dp", "1"])       # vLLM's short forms, at their neutral 1
    assert main(["generate", "llama-3.1-8b", "-pp", "2"]) == 2
    assert "-pp 2 is not supported by kvfit: pipeline parallelism" in capsys.readouterr().err
    assert parse_args(["serve", "llama-3.1-8b", "--no-enable-log-requests"]).vllm_log_requests is False
    assert parse_args(["serve", "llama-3.1-8b"]).vllm_log_requests is True
