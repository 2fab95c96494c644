"""What a vLLM user's first day ran into: a message's text parts reach the template as vLLM joins them,
OpenAI fields whose silent no-op would change the answer are a 400 naming them, and a SIGTERM to the
whole process group (systemd's stop, `timeout`) is a clean stop, not "the engine stopped while serving"."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import httpx
import openai
import pytest

from fake_engine import FakeEngine
from server_testing import running_server, wait_healthy

TEMPLATE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"


@pytest.fixture(scope="module")
def server():
    with running_server(FakeEngine(), "fake", chat_template=TEMPLATE) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=30)


def rendered(server: str, messages: list[dict]) -> str:
    r = httpx.post(f"{server}/tokenize", json={"messages": messages, "add_generation_prompt": False})
    assert r.status_code == 200, r.text
    return "".join(chr(t) for t in r.json()["tokens"])      # the fake tokenizer: a token per character


def test_text_parts_are_joined_by_a_line_break_as_vllm_does(server):
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    assert rendered(server, [{"role": "user", "content": parts}]) == "[user]Hi\nthere"


def test_chat_echo_repeats_text_parts_as_the_template_saw_them(client):
    parts = [{"type": "text", "text": "Sure"}, {"type": "text", "text": "thing"}]
    resp = client.chat.completions.create(model="fake", max_tokens=1, messages=[
        {"role": "user", "content": "x"}, {"role": "assistant", "content": parts}],
        extra_body={"echo": True, "add_generation_prompt": False, "continue_final_message": True})
    assert resp.choices[0].message.content.startswith("Sure\nthing")


@pytest.mark.parametrize("field, value, needle", [
    ("functions", [{"name": "f", "parameters": {"type": "object"}}], "send them as tools"),
    ("function_call", "auto", "tool_choice"),
    ("audio", {"voice": "alloy", "format": "wav"}, "audio output"),
    ("modalities", ["text", "audio"], "audio output"),
    ("web_search_options", {}, "web search"),
])
def test_openai_chat_fields_that_would_change_the_answer_are_a_400_naming_them(client, field, value, needle):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={field: value})
    error = info.value.body
    assert error["param"] == field and needle in error["message"] and "not supported by kvfit" in error["message"]


def test_their_neutral_values_are_served(client):
    resp = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          extra_body={"modalities": ["text"], "function_call": "none",
                                                      "functions": []})
    assert resp.choices[0].finish_reason == "length"


def test_max_completion_tokens_on_completions_is_a_400_not_a_lost_limit(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="fake", prompt="hi", extra_body={"max_completion_tokens": 3})
    assert info.value.body["param"] == "max_completion_tokens"
    assert "/v1/completions takes max_tokens" in info.value.body["message"]
    chat = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}],
                                          max_completion_tokens=3)
    assert chat.usage.completion_tokens == 3          # chat's own field, honoured


def test_a_sigterm_to_the_process_group_is_a_clean_stop(tiny_llama, tmp_path):
    """systemd's stop (KillMode=control-group), `timeout` and `kill -- -PGID` signal every process of the
    server: the engine core must not die first and make the front-end report a dead engine (exit 1)."""
    cmd = [sys.executable, "-m", "kvfit.cli", "serve", tiny_llama, "--port", "0", "--device", "cpu",
           "--dtype", "float32", "--max-model-len", "128", "--num-gpu-blocks-override", "32"]
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            for line in proc.stdout:
                if match := re.search(r"listening on (http://\S+)", line):
                    break
            else:
                pytest.fail("kvfit serve did not start: " + (tmp_path / "stderr.txt").read_text())
            wait_healthy(match.group(1))
            r = httpx.post(f"{match.group(1)}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
            assert r.status_code == 200
            os.killpg(proc.pid, signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    log = (tmp_path / "stderr.txt").read_text()
    assert "engine stopped" not in log and "Traceback" not in log and "leaked" not in log, log


def test_the_reply_role_is_the_last_messages_without_add_generation_prompt(server):
    """vLLM's rule: with add_generation_prompt the reply is the assistant's, else it continues the last message in
    that message's role (it was always 'assistant'), in the full response and in the stream's first chunk."""
    url = f"{server}/v1/chat/completions"
    base = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(url, json=base).json()["choices"][0]["message"]["role"] == "assistant"
    open_turn = dict(base, add_generation_prompt=False)
    assert httpx.post(url, json=open_turn).json()["choices"][0]["message"]["role"] == "user"
    with httpx.stream("POST", url, json=dict(open_turn, stream=True)) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
    assert '"role":"user"' in first.replace(" ", "")
