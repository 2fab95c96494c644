"""`python -m kvfit.cli serve` as a process: start-up lines, a request, SIGTERM mid-stream, exit 0."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading

import openai
import pytest

from server_testing import wait_healthy


def start(model_path: str, *flags: str, stderr, env: dict | None = None) -> tuple[subprocess.Popen, "queue.Queue[str]"]:
    cmd = [sys.executable, "-m", "kvfit.cli", "serve", model_path, "--port", "0", "--device", "cpu",
           "--dtype", "float32", "--max-model-len", "128", "--num-gpu-blocks-override", "32", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True,
                            env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    return proc, lines


@contextlib.contextmanager
def serving(model_path: str, *flags: str, log_path, env: dict | None = None):
    """`kvfit serve` as a process, its stderr in log_path (read it after the block); yields
    (process, stdout lines); killed at the end of the block if it still runs."""
    with open(log_path, "w") as err:
        proc, lines = start(model_path, *flags, stderr=err, env=env)
        try:
            yield proc, lines
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def read_until(lines: "queue.Queue[str]", pattern: str, timeout_s: float = 60.0) -> tuple[re.Match, list[str]]:
    seen = []
    while True:
        line = lines.get(timeout=timeout_s)
        seen.append(line)
        match = re.search(pattern, line)
        if match:
            return match, seen


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_prints_capacity_and_url_and_exits_0_on_a_signal(tiny_llama, tmp_path, sig):
    with serving(tiny_llama, "--served-model-name", "tiny", "--api-key", "k", log_path=tmp_path / "stderr.txt") \
            as (proc, lines):
        match, seen = read_until(lines, r"listening on (http://127\.0\.0\.1:\d+)")
        assert not any(line.startswith("capacity: ") for line in seen), seen      # the log has it, once
        url = match.group(1)
        wait_healthy(url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=30)
        resp = client.completions.create(model="tiny", prompt="Hello", max_tokens=3,
                                         extra_body={"ignore_eos": True})
        assert resp.usage.completion_tokens == 3
        stream = iter(client.completions.create(model="tiny", prompt="Hello", max_tokens=100, stream=True,
                                                extra_body={"ignore_eos": True}))
        next(stream)
        proc.send_signal(sig)
        with pytest.raises(openai.APIError, match="shutting down"):   # ended, explicitly
            for _ in stream:
                pass
        assert proc.wait(timeout=30) == 0
    log = (tmp_path / "stderr.txt").read_text()
    read_until(lines, r"kvfit serve: stopped", timeout_s=5)
    assert "Traceback" not in log, log
    assert sum("[kvfit] KV cache: " in line and "blocks" in line for line in log.splitlines()) == 1, log


TEMPLATE = "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "


def test_serve_names_template_and_log_lines(tiny_llama, tmp_path):
    """Several --served-model-name, --chat-template from a file, and the log: one format with a
    timestamp for kvfit's and uvicorn's lines, an access line per request."""
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE, encoding="utf-8")
    log_path = tmp_path / "stderr.txt"
    with serving(tiny_llama, "--served-model-name", "first", "second", "--chat-template", str(template),
                 "--api-key", "k", log_path=log_path) as (proc, lines):
        url = read_until(lines, r"listening on (http://127\.0\.0\.1:\d+)")[0].group(1)
        wait_healthy(url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=30)
        assert [m.id for m in client.models.list().data] == ["first", "second"]
        resp = client.chat.completions.create(model="second", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=2)
        assert resp.model == "first"
        from transformers import AutoTokenizer
        expected = AutoTokenizer.from_pretrained(tiny_llama).apply_chat_template(
            [{"role": "user", "content": "Hi"}], chat_template=TEMPLATE, tokenize=True)["input_ids"]
        assert resp.usage.prompt_tokens == len(expected)
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    log = log_path.read_text()
    stamp = r"(INFO|WARNING) \d\d-\d\d \d\d:\d\d:\d\d\.\d{3} \["
    assert re.search(stamp + r"uvicorn\.error\] Application startup complete", log), log
    assert re.search(stamp + r'kvfit\.access\] 127\.0\.0\.1:\d+ "POST /v1/chat/completions" 200 [\d.]+s '
                     rf"prompt_tokens={len(expected)} output_tokens=2", log), log
    assert "Traceback" not in log


def test_serve_refuses_a_chat_template_that_is_not_there_in_one_line(tiny_llama, tmp_path):
    cmd = [sys.executable, "-m", "kvfit.cli", "serve", tiny_llama, "--device", "cpu",
           "--chat-template", str(tmp_path / "missing.jinja")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    [line] = [x for x in proc.stderr.splitlines() if x.strip()]
    assert line.startswith("error: --chat-template") and "is not a file" in line, proc.stderr
