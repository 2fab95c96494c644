"""`vllm serve` flags a vLLM user copies that kvfit serve did not know: refused with the reason (one line,
exit 2), their neutral value accepted, instead of argparse's bare 'unrecognized arguments'."""

from __future__ import annotations

import pytest

from kvfit.cli import main, parse_args


@pytest.mark.parametrize("argv, needle", [
    (["--response-role", "user"], "role assistant"),
    (["--root-path", "/api"], "strips the prefix"),
])
def test_vllm_server_flags_kvfit_cannot_honour_say_why(argv, needle, capsys):
    assert main(["serve", "qwen3-0.6b", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {argv[0]} {argv[1]} is not supported by kvfit")
    assert needle in err


def test_the_default_response_role_is_accepted():
    assert parse_args(["serve", "qwen3-0.6b", "--response-role", "assistant"]).model == "qwen3-0.6b"
