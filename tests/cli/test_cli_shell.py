"""The command line in a shell: a closed stdout (`kvfit plan ... | head`), --version, `python -m kvfit`,
and --help showing every default."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from importlib import metadata

import pytest

from kvfit.cli import COMMANDS, build_parser


def kvfit_into_closed_pipe(*args) -> subprocess.CompletedProcess:
    """Run kvfit with stdout a pipe whose reader is already gone, as `| head` leaves it."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([sys.executable, "-m", "kvfit", *args], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(write_end)


@pytest.mark.parametrize("args", [["plan", "llama-3.1-8b"], ["plan", "llama-3.1-8b", "--json"],
                                  ["plan", "--help"], ["--help"]], ids=["table", "json", "plan-help", "help"])
def test_a_closed_stdout_ends_quietly(args):
    out = kvfit_into_closed_pipe(*args)
    assert out.stderr == "", out.stderr          # no BrokenPipeError traceback, no "Exception ignored"
    assert out.returncode in (0, 1)


def test_a_closed_stdout_after_generating_ends_quietly(tiny_llama):
    out = kvfit_into_closed_pipe("generate", tiny_llama, "--prompt-token-ids", "5,6", "--max-tokens", "2",
                                 "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "4MiB",
                                 "--max-model-len", "64", "--json")
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr
    assert out.returncode == 1


@pytest.mark.parametrize("module", ["kvfit", "kvfit.cli"])
def test_version_from_the_package_metadata(module):
    out = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == metadata.version("kvfit")
    import kvfit
    assert kvfit.__version__ == metadata.version("kvfit")


def test_python_m_kvfit_runs_a_command():
    out = subprocess.run([sys.executable, "-m", "kvfit", "plan", "qwen3-0.6b", "--device-memory", "24GiB"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "bound by memory" in out.stdout, out.stderr


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_every_default(command):
    sub = _subparsers()[command]
    formatter = sub._get_formatter()
    for action in sub._actions:
        if not action.option_strings or argparse.SUPPRESS in (action.default, action.help):   # MODEL, --help, hidden
            continue
        text = formatter._expand_help(action) if action.help is not None else ""
        assert "default" in text, f"kvfit {command} {action.option_strings[0]}: no default in {text!r}"


def test_help_shows_the_config_default_of_a_flag_left_unset():
    help_text = _subparsers()["generate"].format_help()
    assert "(default: 0.9)" in help_text           # --gpu-memory-utilization: CacheConfig's default
    assert "(default: True)" in help_text          # --enable-prefix-caching
    assert "(default: 16)" in help_text            # --block-size / --max-tokens
