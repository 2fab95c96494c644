"""Before an engine command does any work: the missing folder is the first error, byte sizes need a unit,
--plot checks matplotlib, and a long start-up on the CPU is announced with an estimate and progress lines."""

from __future__ import annotations

import io
import sys
import time

import pytest

from kvfit.cli import main
from kvfit.commands import common
from kvfit.config import EngineConfig

CPU = ["--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "4MiB", "--max-model-len", "64"]


def one_error_line(capsys, argv) -> str:
    status = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize("argv", [
    ["generate", "./missing-folder", "--prompt", "Hi"],             # text prompt: used to blame the tokenizer
    ["generate", "./missing-folder", "--prompt", "Hi", "--prompt-file", "missing.txt"],
    ["serve", "./missing-folder", "--api-key-file", "missing-key"],
    ["profile", "./missing-folder", "--plot", "x.png"],
    ["plan", "./missing-folder"],
], ids=["generate", "generate-prompt-file", "serve", "profile", "plan"])
def test_a_missing_folder_is_the_first_error(capsys, tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    line = one_error_line(capsys, argv)
    assert "./missing-folder" in line and "does not exist" in line, line


@pytest.mark.parametrize("argv,flag", [
    (["plan", "llama-3.1-8b", "--device-memory", "80"], "--device-memory"),
    (["plan", "llama-3.1-8b", "--kv-cache-memory", "20"], "--kv-cache-memory"),
    (["generate", "TINY", "--prompt", "Hi", "--device", "cpu", "--kv-cache-memory", "16777216"], "--kv-cache-memory"),
])
def test_byte_sizes_need_a_unit(capsys, tiny_llama, argv, flag):
    argv = [tiny_llama if a == "TINY" else a for a in argv]
    line = one_error_line(capsys, argv)
    assert line.startswith(f"error: {flag} needs a unit, e.g. 80GiB or 80GB"), line


def test_plot_checks_matplotlib_before_loading(capsys, tiny_llama, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)      # `import matplotlib` raises ImportError
    import kvfit.engine.llm_engine as llm_engine

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine was started before --plot was checked")
    monkeypatch.setattr(llm_engine, "LLMEngine", no_engine)
    line = one_error_line(capsys, ["profile", tiny_llama, *CPU, "--plot", str(tmp_path / "m.png")])
    assert "--plot needs matplotlib" in line


def test_the_cpu_profiles_fewer_tokens_by_default():
    from kvfit.platforms.cpu import CPU_MAX_NUM_BATCHED_TOKENS, CpuPlatform
    config = CpuPlatform().resolve_config(EngineConfig.from_kwargs("qwen3-0.6b", device="cpu"))
    assert config.scheduler.max_num_batched_tokens == CPU_MAX_NUM_BATCHED_TOKENS < 8192
    given = EngineConfig.from_kwargs("qwen3-0.6b", device="cpu", max_num_batched_tokens=512)
    assert CpuPlatform().resolve_config(given).scheduler.max_num_batched_tokens == 512


def test_gpu_memory_utilization_is_refused_on_the_cpu(capsys, tiny_llama):
    line = one_error_line(capsys, ["generate", tiny_llama, "--prompt-token-ids", "5", "--device", "cpu",
                                   "--gpu-memory-utilization", "0.5"])
    assert "--gpu-memory-utilization 0.5" in line and "--kv-cache-memory" in line, line


def test_a_long_cpu_start_is_announced(capsys, tiny_llama, monkeypatch):
    from kvfit.platforms import cpu_startup
    monkeypatch.setattr(cpu_startup, "CPU_SLOW_START_S", 0.0)      # this tiny model counts as slow
    status = main(["generate", tiny_llama, "--prompt-token-ids", "5,6", "--max-tokens", "2", *CPU])
    err = capsys.readouterr().err
    assert status == 0, err
    warning = next(line for line in err.splitlines() if line.startswith("WARNING ") and "] starting " in line)
    assert "on the CPU will take about" in warning and "an estimate" in warning and "measured here" in warning
    assert "[kvfit] started in" in err           # the log's one format (kvfit.server.logs)


def test_progress_lines_until_the_engine_is_up(monkeypatch, tiny_llama):
    monkeypatch.setattr(common, "_slow_start", lambda config: (600.0, "warning: slow"))
    monkeypatch.setattr(common, "PROGRESS_EVERY_S", 0.01)
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    with common.engine_startup(EngineConfig.from_kwargs(tiny_llama)):
        deadline = time.monotonic() + 30       # a bound for a loaded machine, not a timing assertion
        while "still starting" not in stderr.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
    lines = stderr.getvalue().splitlines()
    assert lines[0].startswith("WARNING ") and lines[0].endswith("[kvfit] slow")
    assert any(line.startswith("INFO ") and "[kvfit] still starting," in line and
               "of about 10 min 0 s (estimated)" in line for line in lines)
    assert lines[-1].startswith("INFO ") and "[kvfit] started in" in lines[-1]
