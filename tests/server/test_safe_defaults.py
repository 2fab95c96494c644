"""Safe defaults: where the API key comes from and what keys are refused, the start-up warnings,
DNS rebinding (Host) on a loopback bind, a keyed /metrics, and a prefix-cache hit rate that one
request cannot move."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import httpx
import pytest

from kvfit.errors import ConfigError
from kvfit.server.guards import host_name, is_loopback_host, public_prefix_cache_hit_rate
from kvfit.server.launch import ConnectionLimits, GuardOptions, resolve_api_key, startup_warnings
from kvfit.server.limits import PUBLIC_MIN_PREFIX_CACHE_QUERY_TOKENS
from server_testing import openai_error
from test_input_hygiene import guarded_server


# the API key ------------------------------------------------------------------------------------
def test_the_key_comes_from_the_flag_the_file_or_the_environment(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    env = {"KVFIT_API_KEY": "sk-from-env"}
    assert resolve_api_key("sk-flag", None, env) == "sk-flag"
    assert resolve_api_key(None, str(key_file), env) == "sk-from-file"
    assert resolve_api_key(None, None, env) == "sk-from-env"
    assert resolve_api_key(None, None, {}) is None


@pytest.mark.parametrize("flag, file_text, env, match", [
    ("clé", None, {}, "printable ASCII"),
    (None, "ключ\n", {}, "printable ASCII"),
    (None, None, {"KVFIT_API_KEY": "sk\u00a0x"}, "printable ASCII"),
    ("sk a", None, {}, "printable ASCII"),
    (None, None, {"KVFIT_API_KEY": ""}, "empty"),
    (None, "\n", {}, "empty"),
    ("k", "k", {}, "not both"),
], ids=["non-ascii-flag", "non-ascii-file", "nbsp-env", "inner-space", "empty-env", "empty-file", "both"])
def test_a_key_that_could_never_match_is_refused_in_one_line(tmp_path, flag, file_text, env, match):
    path = None
    if file_text is not None:
        path = tmp_path / "key"
        path.write_text(file_text, encoding="utf-8")
    with pytest.raises(ConfigError, match=match) as info:
        resolve_api_key(flag, None if path is None else str(path), env)
    message = str(info.value)
    assert "\n" not in message and "clé" not in message and "ключ" not in message     # never echoes the key


def test_an_unreadable_key_file_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot read --api-key-file .*missing"):
        resolve_api_key(None, str(tmp_path / "missing"), {})


def test_start_up_warns_without_a_key_and_about_a_key_on_the_command_line():
    [line] = startup_warnings("127.0.0.1", None, key_on_command_line=False)
    assert line.startswith("warning: no API key") and "KVFIT_API_KEY" in line and "this machine" in line
    [line] = startup_warnings("0.0.0.0", None, key_on_command_line=False)
    assert "the network at 0.0.0.0" in line
    [line] = startup_warnings("127.0.0.1", "k", key_on_command_line=True)
    assert "--api-key is visible" in line
    assert startup_warnings("127.0.0.1", "k", key_on_command_line=False) == []


# DNS rebinding ----------------------------------------------------------------------------------
@pytest.mark.parametrize("host, loopback", [
    ("localhost", True), ("LOCALHOST.", True), ("127.0.0.1", True), ("127.1.2.3", True), ("::1", True),
    ("[::1]", True), ("app.localhost", True), ("0.0.0.0", False), ("10.0.0.1", False), ("evil.example", False),
    ("localhost.evil.example", False), ("127.0.0.1.nip.io", False), ("", False)])
def test_loopback_names(host, loopback):
    assert is_loopback_host(host) is loopback


def test_host_name_drops_the_port():
    assert [host_name(h) for h in ("a:80", "a", "[::1]:8000", "[::1]", "127.0.0.1:1")] == \
        ["a", "a", "::1", "::1", "127.0.0.1"]


def test_on_a_loopback_bind_a_foreign_host_is_403_everywhere():
    with guarded_server() as url:
        port = url.rsplit(":", 1)[1]
        for host in ("evil.example", f"evil.example:{port}", "localhost.evil.example", "192.168.1.9"):
            for path in ("/health", "/metrics", "/v1/models"):
                r = httpx.get(f"{url}{path}", headers={"Host": host}, timeout=5)
                assert r.status_code == 403, (host, path, r.text)
                assert openai_error(r)["code"] == "forbidden_host"
        for host in ("localhost", f"localhost:{port}", "127.0.0.1", f"[::1]:{port}", "[::1]"):
            assert httpx.get(f"{url}/v1/models", headers={"Host": host}, timeout=5).status_code == 200, host


def test_on_a_loopback_bind_an_empty_or_missing_host_is_403():
    with guarded_server() as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        # an empty Host (HTTP/1.1) and none at all (HTTP/1.0) name no loopback host either
        for head in (b"GET /v1/models HTTP/1.1\r\nHost: \r\nConnection: close\r\n\r\n",
                     b"GET /v1/models HTTP/1.0\r\n\r\n"):
            with socket.create_connection((host, int(port)), timeout=5) as sock:
                sock.sendall(head)
                reply = b""
                while chunk := sock.recv(65536):
                    reply += chunk
            status_line, _, rest = reply.partition(b"\r\n")
            assert b" 403 " in status_line, reply
            assert json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["code"] == "forbidden_host"


def test_on_a_public_bind_any_host_is_served():
    with guarded_server(bind_host="0.0.0.0") as url:
        assert httpx.get(f"{url}/v1/models", headers={"Host": "api.example.com"}, timeout=5).status_code == 200


# /metrics ---------------------------------------------------------------------------------------
def test_metrics_require_key_answers_401_without_it():
    with guarded_server(api_key="sk-m", metrics_require_key=True) as url:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-m"}):
            r = httpx.get(f"{url}/metrics", headers=headers, timeout=5)
            assert r.status_code == 401 and openai_error(r)["code"] == "invalid_api_key", headers
        r = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer sk-m"}, timeout=5)
        assert r.status_code == 200 and "kvfit_kv_blocks_total" in r.text
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200          # health stays open
    with guarded_server(api_key="sk-m") as url:                                # the default: open
        assert httpx.get(f"{url}/metrics", timeout=5).status_code == 200


def test_guard_options_are_checked_when_built():
    with pytest.raises(ConfigError, match="--metrics-require-key needs an API key"):
        GuardOptions("127.0.0.1", None, metrics_require_key=True)
    for seconds in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match="--body-timeout must be a positive number"):
            GuardOptions("127.0.0.1", body_timeout_s=seconds)
    for kwargs in ({"max_connections": 0}, {"header_timeout_s": 0}, {"header_timeout_s": float("nan")}):
        with pytest.raises(ConfigError, match="--max-connections|--header-timeout"):
            ConnectionLimits(**kwargs)


def test_the_public_hit_rate_hides_one_request():
    n = PUBLIC_MIN_PREFIX_CACHE_QUERY_TOKENS
    assert public_prefix_cache_hit_rate(0, 0) == 0.0
    assert public_prefix_cache_hit_rate(n - 1, n - 1) == 0.0            # too few lookups: nothing shown
    assert public_prefix_cache_hit_rate(n // 2, n) == 0.5
    # one more request of 128 prompt tokens, all hits or all misses: the same figure
    assert public_prefix_cache_hit_rate(n // 2 + 128, n + 128) == public_prefix_cache_hit_rate(n // 2, n + 128)


def test_an_open_metrics_scrape_shows_no_prefix_cache_counts():
    from fake_engine import FakeEngine
    from kvfit.server.metrics import ServerMetrics
    stats = {**FakeEngine().stats(), "prefix_cache_queries": 1000, "prefix_cache_hits": 37}
    public = ServerMetrics(lambda: stats).render().decode()
    assert "kvfit_prefix_cache_hits" not in public and "kvfit_prefix_cache_queries" not in public
    assert "\nkvfit_prefix_cache_hit_rate 0.0\n" in public
    exact = ServerMetrics(lambda: stats, exact_prefix_cache=True).render().decode()
    assert "\nkvfit_prefix_cache_hits_total 37.0\n" in exact and "\nkvfit_prefix_cache_hit_rate 0.037\n" in exact


# the CLI ----------------------------------------------------------------------------------------
def test_serve_refuses_a_non_ascii_key_from_the_environment_in_one_line(tiny_llama):
    cmd = [sys.executable, "-m", "kvfit.cli", "serve", tiny_llama, "--port", "0", "--device", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "KVFIT_API_KEY": "clé"})
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    [line] = [x for x in proc.stderr.splitlines() if x.strip()]
    assert line.startswith("error:") and "printable ASCII" in line, proc.stderr


def test_serve_without_a_key_warns_and_refuses_a_foreign_host(tiny_llama, tmp_path):
    from test_server_cli import read_until, serving
    env = {k: v for k, v in os.environ.items() if k != "KVFIT_API_KEY"}
    with serving(tiny_llama, "--served-model-name", "tiny", log_path=tmp_path / "stderr.txt", env=env) \
            as (proc, _lines):
        url = read_until(_lines, r"listening on (http://127\.0\.0\.1:\d+)")[0].group(1)
        assert httpx.get(f"{url}/health", headers={"Host": "rebound.example"}, timeout=10).status_code == 403
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    log = (tmp_path / "stderr.txt").read_text()
    assert "WARNING" in log and "no API key is set" in log and "Traceback" not in log, log
