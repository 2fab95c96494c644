"""server/stack_sampler.py: off without $KVFIT_STACK_SAMPLES; with it, a process writes its threads' stacks (CPU
time per collapsed stack, py-spy's raw format) under its process and thread frames; bench_serve reads the files with
its py-spy parser; a real `kvfit serve` leaves one file per process."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time

import httpx
import pytest

from kvfit.errors import ConfigError
from kvfit.server import stack_sampler
from kvfit.server.stack_sampler import FOLDER_ENV, INTERVAL_ENV, StackSampler, sample_files, sampling
from server_testing import wait_healthy
from test_server_cli import read_until, serving

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from bench_serve import print_stacks, sampled_since, sampled_stacks, spy_stacks  # noqa: E402


def _spin_main(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        sum(range(1000))


def _spin_worker(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))


ALIVE: set[str] = set()      # names of the threads alive while _sampled sampled (earlier tests may leave some)


def _sampled(tmp_path, monkeypatch) -> tuple[StackSampler, float, bool]:
    """A sampler (1 ms) over 0.3 s of CPU in the main thread (_spin_main) and a worker (_spin_worker): (the sampler,
    the main thread's CPU seconds, whether the file was there before stop())."""
    ALIVE.update(t.name for t in threading.enumerate())
    monkeypatch.setattr(stack_sampler, "FLUSH_S", 0.05)
    sampler = StackSampler.from_environment("kvfit-test", {FOLDER_ENV: str(tmp_path / "stacks"), INTERVAL_ENV: "1"})
    stop = threading.Event()
    worker = threading.Thread(target=_spin_worker, args=(stop,), name="kvfit-test-worker", daemon=True)
    worker.start()
    assert sampler.start()
    try:
        start = time.thread_time()
        _spin_main(0.3)
        main_cpu_s = time.thread_time() - start
        time.sleep(0.1)                              # a rewrite by the writer thread
        written_while_running = os.path.exists(sampler.path)
        ALIVE.update(t.name for t in threading.enumerate())
    finally:
        sampler.stop()
        stop.set()
        worker.join()
    return sampler, main_cpu_s, written_while_running


def test_a_busy_process_writes_collapsed_stacks_under_its_process_and_thread_frames(tmp_path, monkeypatch):
    sampler, main_cpu_s, written_while_running = _sampled(tmp_path, monkeypatch)
    assert written_while_running                     # a killed process still leaves what it had
    assert sampler.path == str(tmp_path / "stacks" / f"kvfit-test-{os.getpid()}.txt")
    stacks = list(spy_stacks(sampler.path))
    assert len(stacks) == len(open(sampler.path).read().splitlines())    # every line parses
    per_thread: dict[str, int] = {}
    for frames, count in stacks:
        assert frames[0] == f"process kvfit-test pid {os.getpid()}"
        thread = re.fullmatch(r"thread \(\d+\): (.+)", frames[1]).group(1)
        per_thread[thread] = per_thread.get(thread, 0) + count
        assert all(re.fullmatch(r".+ \(.+:\d+\)", frame) for frame in frames[2:]), frames
    # the writer thread is left out; threads earlier tests left running in this process (tqdm's monitor) may show
    assert "kvfit-stack-sampler" not in per_thread
    assert {"MainThread", "kvfit-test-worker"} <= set(per_thread)
    assert set(per_thread) <= {"MainThread", "kvfit-test-worker"} | ALIVE
    main = [frames for frames, _ in stacks if frames[1].endswith(": MainThread")]
    assert any(re.fullmatch(r"_spin_main \(test_stack_sampler\.py:\d+\)", frame) for frames in main for frame in frames)
    assert any("_spin_worker (test_stack_sampler.py:" in frame for frames, _ in stacks for frame in frames
               if frames[1].endswith(": kvfit-test-worker"))
    # counts are CPU microseconds: the main thread's add up to the CPU it used (less the last interval)
    assert 0.8 * main_cpu_s * 1e6 <= per_thread["MainThread"] <= 1.05 * main_cpu_s * 1e6 + 2000
    assert signal.getsignal(signal.SIGPROF) in (signal.SIG_IGN, signal.SIG_DFL)     # its handler is gone


def test_bench_serve_reads_the_files_with_its_py_spy_parser(tmp_path, monkeypatch, capsys):
    sampler, _, _ = _sampled(tmp_path, monkeypatch)
    folder = str(tmp_path / "stacks")
    assert sample_files(folder, {os.getpid()}) == [sampler.path]
    assert sample_files(folder, {os.getpid() + 1}) == []
    counts = sampled_stacks(folder, {os.getpid()})
    assert sum(counts.values()) == sum(count for _, count in spy_stacks(sampler.path))
    assert sampled_since(folder, {os.getpid()}, counts) == []             # nothing new since that reading
    print_stacks(sampled_since(folder, {os.getpid()}, type(counts)()), "stack samples")
    out = capsys.readouterr().out
    assert f"stack samples process kvfit-test pid {os.getpid()}: 100% of samples; self time:" in out
    assert "_spin_main (test_stack_sampler.py:" in out


def test_off_without_the_variable(monkeypatch):
    monkeypatch.delenv(FOLDER_ENV, raising=False)
    assert StackSampler.from_environment("kvfit-test", {}) is None
    handler, threads = signal.getsignal(signal.SIGPROF), threading.active_count()
    with sampling("kvfit-test"):
        assert threading.active_count() == threads
        assert signal.getsignal(signal.SIGPROF) == handler
        assert signal.getitimer(signal.ITIMER_PROF) == (0.0, 0.0)


@pytest.mark.parametrize("value", ["0", "fast", "1e9"])
def test_a_bad_interval_is_one_line_naming_the_variable(tmp_path, value):
    with pytest.raises(ConfigError, match=f"KVFIT_STACK_SAMPLE_MS must be .* got '{value}'"):
        StackSampler.from_environment("kvfit-test", {FOLDER_ENV: str(tmp_path), INTERVAL_ENV: value})


@pytest.mark.parametrize("below", ["file", "file/below"])
def test_a_folder_that_cannot_be_made_is_one_line_naming_the_variable(tmp_path, below):
    (tmp_path / "file").touch()                      # a file where the folder would be, or above it
    folder = str(tmp_path / below)
    with pytest.raises(ConfigError, match=f"KVFIT_STACK_SAMPLES must name a folder .* got '{folder}'"):
        StackSampler.from_environment("kvfit-test", {FOLDER_ENV: folder})


def test_a_file_it_cannot_write_leaves_no_timer_or_handler(tmp_path):
    sampler = StackSampler(str(tmp_path / "gone"), "kvfit-test")      # its folder removed after from_environment
    handler = signal.getsignal(signal.SIGPROF)
    assert sampler.start() is False
    assert signal.getsignal(signal.SIGPROF) == handler and sampler._timer is None
    sampler.stop()                                   # nothing to stop


def test_outside_the_main_thread_it_does_not_sample(tmp_path):
    sampler = StackSampler(str(tmp_path), "kvfit-test")
    started = []
    thread = threading.Thread(target=lambda: started.append(sampler.start()))
    thread.start()
    thread.join()
    assert started == [False] and not os.path.exists(sampler.path)
    sampler.stop()                                   # nothing to stop


def test_kvfit_serve_leaves_a_file_per_process(tiny_llama, tmp_path):
    """Both processes of a real `kvfit serve` sample themselves and write their files when it stops (SIGTERM)."""
    folder = tmp_path / "stacks"
    env = {**os.environ, FOLDER_ENV: str(folder), INTERVAL_ENV: "1"}
    with serving(tiny_llama, "--served-model-name", "tiny", log_path=tmp_path / "stderr.txt", env=env) \
            as (proc, lines):
        url = read_until(lines, r"listening on (http://127\.0\.0\.1:\d+)", timeout_s=120)[0].group(1)
        wait_healthy(url)
        for _ in range(3):
            r = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": "Hello there", "max_tokens": 16, "ignore_eos": True})
            assert r.status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    files = {re.fullmatch(r"(kvfit-[a-z]+)-\d+\.txt", name).group(1): folder / name for name in os.listdir(folder)}
    assert set(files) == {"kvfit-frontend", "kvfit-core"}, os.listdir(folder)
    assert files["kvfit-frontend"].name == f"kvfit-frontend-{proc.pid}.txt"
    core_pid = int(files["kvfit-core"].stem.rsplit("-", 1)[1])
    for role, pid, entry in (("kvfit-frontend", proc.pid, "kvfit/server/"),
                             ("kvfit-core", core_pid, "_CoreLoop.run (kvfit/server/core_process.py:")):
        stacks = list(spy_stacks(str(files[role])))
        assert stacks and all(frames[0] == f"process {role} pid {pid}" for frames, _ in stacks)
        assert any(entry in frame for frames, _ in stacks for frame in frames), role
    assert "Traceback" not in (tmp_path / "stderr.txt").read_text()
