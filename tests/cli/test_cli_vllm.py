"""What a vLLM script passes: flags (accepted with vLLM's meaning, mapped, or refused with the reason), the
model once (MODEL or --model, at --revision), and `kvfit generate`'s script-facing output."""

from __future__ import annotations

import io
import json
import sys

import pytest

from kvfit.cli import main, parse_args
from kvfit.errors import ConfigError

TINY_FLAGS = ["--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", "64",
              "--max-num-batched-tokens", "64", "--max-num-seqs", "4"]


def test_no_arguments_lists_the_commands(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    assert all(command in out for command in ("plan", "generate", "serve", "profile"))


def test_an_unknown_flag_points_to_the_commands_help(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["serve", "qwen3-0.6b", "--no-such-flag", "1"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: unrecognized arguments: --no-such-flag 1 (see `kvfit serve --help`)"


def test_model_as_vllms_model_flag_once():
    assert parse_args(["plan", "--model", "qwen3-0.6b"]).model == "qwen3-0.6b"
    assert parse_args(["plan", "qwen3-0.6b", "--model", "qwen3-0.6b"]).model == "qwen3-0.6b"
    for argv, needle in ([["plan"], "a model is required"], [["plan", "a", "--model", "b"], "two models"]):
        with pytest.raises(ConfigError, match=needle):
            parse_args(argv)


def test_flags_vllm_scripts_pass_are_accepted():
    args = parse_args(["serve", "qwen3-0.6b", "--trust-remote-code", "--enable-chunked-prefill", "--swap-space", "4",
                       "--max-log-len", "100", "--disable-log-requests", "--disable-log-stats",
                       "--uvicorn-log-level", "debug", "--pipeline-parallel-size", "1", "--task", "generate",
                       "--tokenizer", "qwen3-0.6b", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert not args.vllm_log_requests and args.vllm_disable_log_stats and args.uvicorn_log_level == "debug"
    assert parse_args(["serve", "qwen3-0.6b", "--enable-log-requests"]).vllm_log_requests


@pytest.mark.parametrize("argv, needle", [
    (["--no-enable-chunked-prefill"], "always splits long prompts"),
    (["--pipeline-parallel-size", "2"], "pipeline parallelism"),
    (["--enable-lora"], "LoRA"),
    (["--ssl-keyfile", "k.pem"], "TLS"),
    (["--api-server-count", "4"], "one HTTP front-end process"),
    (["--task", "embed"], "no pooling or embedding"),
    (["--hf-overrides", '{"a": 1}'], "config.json is read as it is"),
    (["--download-dir", "/d"], "never downloaded"),
    (["--distributed-executor-backend", "ray"], "processes of this host"),
])
def test_flags_kvfit_cannot_honour_are_one_line_errors_with_the_reason(argv, needle, capsys):
    assert main(["serve", "qwen3-0.6b", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {argv[0]}") and needle in err


def test_tokenizer_must_name_the_models_folder(tiny_llama, tiny_qwen2):
    assert parse_args(["plan", tiny_llama, "--tokenizer", tiny_llama]).model == tiny_llama
    with pytest.raises(ConfigError, match="--tokenizer .* is not the model's folder"):
        parse_args(["plan", tiny_llama, "--tokenizer", tiny_qwen2])


def test_generate_json_has_finish_reason_and_counts_and_reads_prompts_from_stdin(tiny_llama, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello there\n\nthe quick brown fox\n"))
    status = main(["generate", tiny_llama, "--prompt-file", "-", "--max-tokens", "3", "--temperature", "0",
                   "--ignore-eos", "--json", *TINY_FLAGS])
    assert status == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in rows] == ["hello there", "the quick brown fox"]
    for r in rows:
        assert r["finish_reason"] == "length" and r["num_output_tokens"] == 3 == len(r["token_ids"])
        assert r["num_prompt_tokens"] > 1 and "stop_reason" in r


def test_generate_without_weights_fails_before_any_start_up_warning(capsys):
    assert main(["generate", "qwen3-0.6b", "--prompt-token-ids", "1,2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no model.safetensors") and "warning" not in err
