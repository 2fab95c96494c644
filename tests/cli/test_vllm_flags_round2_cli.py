"""More `vllm serve` flags: those kvfit honours parse to vLLM's defaults and values (the server side:
tests/server/test_vllm_flags_round2.py), those it cannot honour are one-line errors that say why (exit 2), their
neutral values accepted; --kv-cache-memory-bytes is vLLM's name of --kv-cache-memory."""

from __future__ import annotations

import pytest

from kvfit.cli import main, parse_args
from kvfit.commands.serve import frontend_options
from kvfit.errors import ConfigError
from kvfit.server.frontend import FrontendOptions

MODEL = "qwen3-0.6b"        # a catalog name: parsing reads no files


@pytest.mark.parametrize("argv, needle", [
    (["--scheduling-policy", "priority"], "first come, first served"),
    (["--logprobs-mode", "processed_logprobs"], "raw fp32 log-softmax"),
    (["--logprobs-mode", "raw_logits"], "raw fp32 log-softmax"),
    (["--logprobs-mode", "processed_logits"], "raw fp32 log-softmax"),
    (["--model-impl", "transformers"], "its own implementation"),
    (["--model-impl", "vllm"], "its own implementation"),
    (["--config-format", "mistral"], "Hugging Face config.json"),
    (["--max-parallel-loading-workers", "4"], "no loading-worker setting"),
    (["--disable-frontend-multiprocessing"], "its own process"),
    (["--middleware", "my.module.Middleware"], "imports no code"),
    (["--ssl-ca-certs", "ca.pem"], "TLS"),
    (["--ssl-cert-reqs", "2"], "TLS"),
])
def test_flags_kvfit_cannot_honour_say_why(argv, needle, capsys):
    assert main(["serve", MODEL, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {' '.join(argv)} is not supported by kvfit")
    assert needle in err


def test_their_neutral_values_are_accepted():
    args = parse_args(["serve", MODEL, "--scheduling-policy", "fcfs", "--logprobs-mode", "raw_logprobs",
                       "--model-impl", "auto", "--config-format", "hf", "--ssl-cert-reqs", "0",
                       "--disable-fastapi-docs"])
    assert args.model == MODEL and args.disable_fastapi_docs
    assert parse_args(["serve", MODEL, "--config-format", "auto"]).model == MODEL
    assert parse_args(["generate", MODEL, "--scheduling-policy", "fcfs"]).model == MODEL     # an engine flag


def test_frontend_flags_default_to_vllms():
    assert frontend_options(parse_args(["serve", MODEL])) == FrontendOptions()
    options = FrontendOptions()
    assert options.allowed_origins == options.allowed_methods == options.allowed_headers == ("*",)
    assert not (options.allow_credentials or options.enable_request_id_headers or options.enable_prompt_tokens_details
                or options.enable_force_include_usage or options.return_tokens_as_token_ids)
    assert options.chat_template_content_format == "auto" and options.content_format == "auto"     # resolved per template


def test_frontend_flags_parse_as_vllm_spells_them():
    args = parse_args(["serve", MODEL, "--allowed-origins", '["http://a.example", "http://b.example"]',
                       "--allowed-methods", '["GET", "POST"]', "--allowed-headers", '["authorization"]',
                       "--allow-credentials", "--enable-request-id-headers", "--enable-prompt-tokens-details",
                       "--enable-force-include-usage", "--return-tokens-as-token-ids",
                       "--chat-template-content-format", "openai",
                       "--override-generation-config", '{"temperature": 0.5, "max_new_tokens": 64, "top_p": null}'])
    assert frontend_options(args) == FrontendOptions(
        allowed_origins=("http://a.example", "http://b.example"), allowed_methods=("GET", "POST"),
        allowed_headers=("authorization",), allow_credentials=True, enable_request_id_headers=True,
        enable_prompt_tokens_details=True, enable_force_include_usage=True, return_tokens_as_token_ids=True,
        chat_template_content_format="openai",
        override_generation_config={"temperature": 0.5, "max_new_tokens": 64, "top_p": None})
    off = parse_args(["serve", MODEL, "--enable-prompt-tokens-details", "--no-enable-prompt-tokens-details"])
    assert not off.enable_prompt_tokens_details


@pytest.mark.parametrize("argv, message", [
    (["--allowed-origins", "*"], "error: --allowed-origins must be JSON, got '*'"),
    (["--allowed-origins", '"*"'], "error: --allowed-origins must be a JSON list of strings like '[\"*\"]', got \"*\""),
    (["--allowed-methods", "[1]"], "error: --allowed-methods must be a JSON list of strings"),
    (["--override-generation-config", "{temperature: 1}"], "error: --override-generation-config must be JSON"),
    (["--override-generation-config", '{"do_sample": true}'],
     "error: --override-generation-config has no field 'do_sample'; its fields are repetition_penalty, temperature"),
    (["--override-generation-config", '{"max_tokens": 8}'], "max_tokens is max_new_tokens"),
    (["--override-generation-config", '{"top_k": 1.5}'], "'top_k' must be"),
    (["--override-generation-config", "[" * 100000], "error: --override-generation-config must be JSON"),
    (["--chat-template-content-format", "jinja"], "error: argument --chat-template-content-format: invalid choice"),
])
def test_bad_frontend_values_are_one_line_errors(argv, message, capsys):
    try:
        status = main(["serve", MODEL, *argv])
    except SystemExit as exc:          # argparse's own errors (a choice) exit from the parser
        status = exc.code
    assert status == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_kv_cache_memory_bytes_is_vllms_name_of_kv_cache_memory(capsys):
    assert parse_args(["plan", MODEL, "--kv-cache-memory-bytes", "21474836480"]).kv_cache_memory == 20 * 2**30
    assert parse_args(["serve", MODEL, "--kv-cache-memory-bytes", "20GiB"]).kv_cache_memory == 20 * 2**30
    assert parse_args(["plan", MODEL, "--kv-cache-memory", "1GiB", "--kv-cache-memory", "2GiB"]).kv_cache_memory \
        == "2GiB"                                               # one flag twice: the last, as before
    from kvfit.commands.flags import engine_kwargs
    from kvfit.config import EngineConfig
    args = parse_args(["plan", MODEL, "--kv-cache-memory-bytes", "1073741824"])
    assert EngineConfig.from_kwargs(args.model, **engine_kwargs(args)).cache.kv_cache_memory == 2**30
    for argv in (["--kv-cache-memory", "1GiB", "--kv-cache-memory-bytes", "1073741824"],
                 ["--kv-cache-memory-bytes", "1073741824", "--kv-cache-memory", "1GiB"]):
        assert main(["plan", MODEL, *argv]) == 2
        assert capsys.readouterr().err == ("error: give --kv-cache-memory or --kv-cache-memory-bytes (vLLM's name "
                                           "for it), not both\n")
    assert main(["plan", MODEL, "--kv-cache-memory-bytes", "lots"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --kv-cache-memory-bytes 'lots' is not a byte size")


def test_llm_takes_kv_cache_memory_bytes(monkeypatch):
    from kvfit import LLM
    monkeypatch.setattr(LLM, "_start", lambda self, config: setattr(self, "config", config))
    assert LLM(MODEL, kv_cache_memory_bytes=2**30).config.cache.kv_cache_memory == 2**30
    assert LLM(MODEL, kv_cache_memory_bytes=None, kv_cache_memory="1GiB").config.cache.kv_cache_memory == 2**30
    with pytest.raises(ConfigError, match="give kv_cache_memory or kv_cache_memory_bytes"):
        LLM(MODEL, kv_cache_memory="1GiB", kv_cache_memory_bytes=2**30)


def test_the_new_flags_are_in_serve_help(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--allowed-origins", "--allowed-methods", "--allowed-headers", "--allow-credentials",
                 "--disable-fastapi-docs", "--enable-prompt-tokens-details", "--enable-force-include-usage",
                 "--return-tokens-as-token-ids", "--kv-cache-memory-bytes", "--scheduling-policy", "--logprobs-mode",
                 "--chat-template-content-format", "--enable-request-id-headers", "--ssl-ca-certs", "--ssl-cert-reqs",
                 "--model-impl", "--config-format", "--max-parallel-loading-workers",
                 "--disable-frontend-multiprocessing", "--middleware", "--override-generation-config"):
        assert flag in out, flag
