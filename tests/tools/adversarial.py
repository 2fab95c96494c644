"""Adversarial inputs against a real `kvfit serve` subprocess and the real CLI (issues 12 and 27).

Builds a tiny random Llama folder (the recipe of tests/tiny_models.py, copied), starts
`python3 -m kvfit.cli serve` on CPU with an API key (KVFIT_API_KEY), sends a few hundred seeded
adversarial HTTP requests (issue 27's cases among them: ISSUE_27_CASES of tests/server/test_adversarial.py,
which pytest runs on its own as well), then runs `kvfit generate/plan` on corrupt model folders and bad flags.
Counts per category: inputs tried, handled cleanly (4xx or the expected success), 5xx, tracebacks.

    python3 tests/tools/adversarial.py --out benchmarks/results/2026-12-03-cpu-adversarial.txt
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

import httpx

# ---------------------------------------------------------------- tiny model (tests/tiny_models.py's recipe, copied)
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))     # this file is tests/tools/adversarial.py
for _folder in (TESTS, os.path.join(TESTS, "server")):                 # tiny_models, test_adversarial
    sys.path.insert(0, _folder)
from tiny_models import BOS, CHAT_TEMPLATE, EOS, UNK  # noqa: E402

CORPUS = """\
The quick brown fox jumps over the lazy dog. A paged key value cache stores attention keys and values
in fixed size blocks, so memory is allocated on demand and shared between sequences with a common prefix.
Hello world! How are you today? I am fine, thank you. What's the weather like? It's sunny and warm.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024. Symbols: + - * / = ( ) [ ] { } < > , . ; : ! ?
Les modèles de langue prédisent le prochain jeton. Über alle Berge. ¿Qué tal? 你好，世界。
"""


def make_tiny_llama(root: str) -> str:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    folder = os.path.join(root, "tiny-llama")
    os.makedirs(folder, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=[UNK, BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines() * 4, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, 1)])
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "unk_token": UNK,
                   "bos_token": BOS, "model_max_length": 512, "clean_up_tokenization_spaces": False,
                   "add_bos_token": True, "add_eos_token": False, "chat_template": CHAT_TEMPLATE}, fh)
    with open(os.path.join(folder, "generation_config.json"), "w", encoding="utf-8") as fh:
        json.dump({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}, fh)
    return folder


# ---------------------------------------------------------------- bookkeeping
class Tally:
    def __init__(self):
        self.rows: dict[str, dict] = {}
        self.failures: list[str] = []
        self.current = "start"           # the category being sent

    def add(self, cat: str, status, clean: bool, detail: str = ""):
        r = self.rows.setdefault(cat, {"n": 0, "clean": 0, "5xx": 0, "tb": 0, "codes": {}})
        r["n"] += 1
        r["codes"][str(status)] = r["codes"].get(str(status), 0) + 1
        if isinstance(status, int) and status >= 500:
            r["5xx"] += 1
        if clean:
            r["clean"] += 1
        elif len(self.failures) < 60:
            self.failures.append(f"[{cat}] status={status} {detail}"[:300])

    def traceback(self, cat: str, detail: str):
        r = self.rows.setdefault(cat, {"n": 0, "clean": 0, "5xx": 0, "tb": 0, "codes": {}})
        r["tb"] += 1
        self.failures.append(f"[{cat}] traceback: {detail}"[:300])


KEY = "adv-secret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def issue_27_cases() -> list:
    """tests/server/test_adversarial.py's ISSUE_27_CASES and its chat-template triggers (one list for both)."""
    from test_adversarial import ISSUE_27_CASES
    return ISSUE_27_CASES


def start_server(model: str, workdir: str):
    env = dict(os.environ, KVFIT_API_KEY=KEY)
    issue_27_cases()
    from test_adversarial import TRIGGERS
    template = os.path.join(workdir, "template.jinja")
    with open(template, "w", encoding="utf-8") as fh:
        fh.write(TRIGGERS + CHAT_TEMPLATE)       # issue 27 (12): a template that loops when a client's kwarg says so
    err_path = os.path.join(workdir, "serve.stderr")
    err = open(err_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "kvfit.cli", "serve", model, "--device", "cpu",
                             "--dtype", "float32", "--max-model-len", "128", "--num-gpu-blocks-override", "64",
                             "--port", "0", "--served-model-name", "tiny-llama",
                             "--chat-template", template], stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    url, lines, deadline = None, [], time.time() + 120
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "listening on " in line:
            url = line.split("listening on ", 1)[1].split()[0].rstrip("/")
            break
    if url is None:
        proc.kill()
        raise SystemExit(f"server did not start:\n{''.join(lines)}\n{open(err_path).read()}")
    # keep draining stdout so the server never blocks on a full pipe
    threading.Thread(target=lambda: [lines.append(l) for l in proc.stdout], daemon=True).start()
    return proc, url, err_path, lines


class Probe:
    """While the attacks run: /health every 50 ms and back-to-back streams, the worst wait of each and how many
    waits passed STALL_S (issue 27: no stall over 100 ms); the server's memory (front end and core processes)
    and its KV cache usage before and after."""

    STALL_S = 0.1

    def __init__(self, url: str, pid: int, tally: Tally):
        self.url, self.pid, self.tally, self.stop = url, pid, tally, threading.Event()
        self.stalls_by_category: dict[str, list[float]] = {}
        self.waits = {"health": [0.0, 0, 0], "stream gap": [0.0, 0, 0]}    # worst, count over STALL_S, samples
        self.threads = [threading.Thread(target=fn, daemon=True) for fn in (self._health, self._stream)]
        self.rss_start = self.rss()

    def rss(self) -> float:
        """MiB resident in the server's process tree (Linux /proc)."""
        children: dict[int, list[int]] = {}
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    parent = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
        tree, frontier = {self.pid}, [self.pid]
        while frontier:
            kids = children.get(frontier.pop(), [])
            tree.update(kids)
            frontier.extend(kids)
        total_kib = 0
        for pid in tree:
            try:
                with open(f"/proc/{pid}/status") as fh:
                    total_kib += next((int(line.split()[1]) for line in fh if line.startswith("VmRSS:")), 0)
            except OSError:
                continue
        return total_kib / 1024

    def kv_usage(self) -> str:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return next((line.split()[-1] for line in text.splitlines() if line.startswith("vllm:kv_cache_usage_perc")), "?")

    def _record(self, what: str, seconds: float) -> None:
        entry = self.waits[what]
        entry[0], entry[1], entry[2] = max(entry[0], seconds), entry[1] + (seconds > self.STALL_S), entry[2] + 1
        if seconds > self.STALL_S:
            self.stalls_by_category.setdefault(f"{what} in {self.tally.current}", []).append(seconds)

    def _health(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as client:
            while not self.stop.is_set():
                start = time.monotonic()
                client.get("/health")
                self._record("health", time.monotonic() - start)
                self.stop.wait(0.05)

    def _stream(self) -> None:
        body = {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 100, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=self.url, timeout=60, headers=AUTH) as client:
            while not self.stop.is_set():
                with client.stream("POST", "/v1/completions", json=body) as response:
                    if response.status_code != 200:         # 429 while the queue is full: try again
                        self.stop.wait(0.05)
                        continue
                    last = None
                    for line in response.iter_lines():
                        now = time.monotonic()
                        if line.startswith("data: {") and last is not None:
                            self._record("stream gap", now - last)
                        last = now if line.startswith("data: {") else last

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def finish(self) -> list[str]:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)
        lines = [f"{what}: worst {worst * 1000:.0f} ms, {slow} of {n} over {self.STALL_S * 1000:.0f} ms"
                 for what, (worst, slow, n) in self.waits.items()]
        lines += [f"  {where}: {len(waits)}, worst {max(waits) * 1000:.0f} ms"
                  for where, waits in sorted(self.stalls_by_category.items(), key=lambda kv: -max(kv[1]))]
        return lines + [f"server memory (front end + core): {self.rss_start:.0f} MiB before the attacks, "
                        f"{self.rss():.0f} MiB after; KV cache usage after: {self.kv_usage()}"]


def log_tracebacks(err_path: str, start: int) -> tuple[int, str]:
    text = open(err_path, errors="replace").read()
    new = text[start:]
    return new.count("Traceback"), new


def run_http(url: str, err_path: str, tally: Tally, rng: random.Random):
    client = httpx.Client(base_url=url, timeout=30.0)
    C, CH = "/v1/completions", "/v1/chat/completions"
    J = {"Content-Type": "application/json", **AUTH}

    def send(cat, method, path, *, content=None, headers=None, ok=(400, 401, 403, 404, 405, 411, 413, 415, 422),
             json_body=None):
        pos = os.path.getsize(err_path)
        tally.current = cat              # the probe names the category a stall happened in
        h = dict(J) if headers is None else headers
        try:
            if json_body is not None:
                content = json.dumps(json_body, allow_nan=True).encode()
            if isinstance(content, str):
                content = content.encode("utf-8", "surrogatepass")
            r = client.request(method, path, content=content, headers=h)
            status, body = r.status_code, r.text[:200]
        except Exception as exc:  # transport error: connection dropped by the server
            status, body = f"EXC:{type(exc).__name__}", str(exc)[:200]
        time.sleep(0.01)
        ntb, _ = log_tracebacks(err_path, pos)
        clean = isinstance(status, int) and status in ok and ntb == 0
        tally.add(cat, status, clean, f"{method} {path} body={(content or b'')[:80]!r} -> {body!r}")
        if ntb:
            tally.traceback(cat, f"{method} {path} body={(content or b'')[:80]!r}")
        return status

    good = {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 4}
    # malformed JSON
    for s in ['{', '{"prompt":', '[]', 'null', '"x"', '{"a":1,}', "{'a':1}", '\x00\x01', '{"prompt":"a"}}', '',
              '{"prompt": "a", "prompt": "b", "max_tokens": 1, "model": "tiny-llama"}'[:-1], '1' * 100,
              '\xff\xfe', '{"model":"tiny-llama","prompt":"a","max_tokens":1e2}']:
        send("malformed JSON", "POST", C, content=s, ok=(400, 422, 200) if "1e2" in s else (400, 422))
        send("malformed JSON", "POST", CH, content=s, ok=(400, 422))
    for _ in range(10):
        junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
        send("malformed JSON", "POST", rng.choice([C, CH]), content=junk, ok=(400, 422))
    # deep nesting
    for depth in (1000, 10000, 100000):
        send("deep nesting", "POST", C, content='{"prompt":' + "[" * depth + "]" * depth + "}")
        send("deep nesting", "POST", C, content='{"model":"tiny-llama","prompt":"a","stop":' + "[" * depth + "]" * depth + "}")
        send("deep nesting", "POST", CH, content='{"messages":[{"role":"user","content":' + '{"a":' * depth + "1" + "}" * depth + "}]}")
        send("deep nesting", "POST", C, content="[" * depth)  # unterminated
    # huge integers
    for field in ("max_tokens", "seed", "top_k", "n", "logprobs", "temperature", "top_p"):
        for v in ("9" * 5000, "-" + "9" * 5000, "1e400", "-1e400", str(2 ** 64), str(2 ** 63)):
            # temperature is at most 2 (vLLM's bound): 2**63 is a 400 now; a 200 stays allowed for older builds
            ok = (200, 400) if field == "temperature" and v == str(2 ** 63) else (400, 401, 403, 404, 405, 411, 413,
                                                                               415, 422)
            send("huge integers", "POST", C, ok=ok,
                 content='{"model":"tiny-llama","prompt":"a","max_tokens":2,"%s":%s}' % (field, v) if field != "max_tokens"
                 else '{"model":"tiny-llama","prompt":"a","max_tokens":%s}' % v)
    send("huge integers", "POST", C, content='{"model":"tiny-llama","prompt":[' + "9" * 5000 + '],"max_tokens":1}')
    # NaN / Infinity
    for field in ("temperature", "top_p", "top_k", "max_tokens", "seed", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "min_p"):
        for v in ("NaN", "Infinity", "-Infinity"):
            send("NaN/Infinity", "POST", C,
                 content='{"model":"tiny-llama","prompt":"a","max_tokens":2,"%s":%s}' % (field, v)
                 if field != "max_tokens" else '{"model":"tiny-llama","prompt":"a","max_tokens":%s}' % v)
    # lone surrogates (JSON escapes and raw bytes)
    for s in ['{"model":"tiny-llama","prompt":"\\ud800","max_tokens":2}',
              '{"model":"tiny-llama","prompt":"a\\udfffb","max_tokens":2}',
              '{"model":"\\ud800","prompt":"a","max_tokens":2}',
              '{"model":"tiny-llama","prompt":"a","max_tokens":2,"stop":["\\ud800"]}',
              '{"model":"tiny-llama","prompt":"a","max_tokens":2,"stop":"\\udc00"}',
              '{"model":"tiny-llama","prompt":["\\ud800","ok"],"max_tokens":2}',
              '{"model":"tiny-llama","messages":[{"role":"user","content":"\\ud800"}],"max_tokens":2}',
              '{"model":"tiny-llama","messages":[{"role":"\\ud800","content":"a"}],"max_tokens":2}',
              '{"model":"tiny-llama","messages":[{"role":"user","content":[{"type":"text","text":"\\udbff"}]}],"max_tokens":2}',
              '{"model":"tiny-llama","prompt":"\\ud800","max_tokens":2,"stream":true}',
              '{"\\ud800":1,"model":"tiny-llama","prompt":"a","max_tokens":2}']:
        path = CH if "messages" in s else C
        send("lone surrogates", "POST", path, content=s, ok=(200, 400, 404, 422))
    send("lone surrogates", "POST", C, content=b'{"model":"tiny-llama","prompt":"\xed\xa0\x80","max_tokens":2}',
         ok=(200, 400, 422))
    # wrong types for every sampling field
    fields = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stream", "stop",
              "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "echo",
              "ignore_eos", "stream_options", "user", "best_of", "logit_bias", "min_tokens", "suffix"]
    bad_values = [None, "x", [], {}, [1, "a"], True, -1, 1.5, {"a": [1]}, "9" * 50]
    for f in fields:
        for v in rng.sample(bad_values, 5):
            body = dict(good, **{f: v})
            send("wrong types", "POST", C, json_body=body, ok=(200, 400, 404, 422))
    for f in ("messages", "max_tokens", "temperature", "stream", "stop", "max_completion_tokens"):
        for v in rng.sample(bad_values, 4):
            body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, f: v}
            send("wrong types", "POST", CH, json_body=body, ok=(200, 400, 404, 422))
    # max_tokens
    for v in (-1, 0, -(10 ** 6), 10 ** 6, 10 ** 9, 2 ** 31, 2 ** 63 - 1, 128, 127, 1):
        send("max_tokens range", "POST", C, json_body=dict(good, max_tokens=v), ok=(200, 400, 422))
    # empty / huge prompts
    for p in ("", [], [[]], [""], " " * 10000, "a" * 100000, "Hello " * 5000, ["a"] * 1000, [[1, 2]] * 100):
        send("empty/huge prompts", "POST", C, json_body=dict(good, prompt=p), ok=(200, 400, 413, 422))
    # token ids out of vocabulary
    for ids in ([320], [10 ** 6], [-1], [2 ** 31], [2 ** 63], [1, 2, 319], [0], [[400]], [1.5], [True], [-(2 ** 63)],
                list(range(200))):
        send("token ids", "POST", C, json_body=dict(good, prompt=ids), ok=(200, 400, 422))
    # content type
    for ct in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data", "", "application/json; charset=utf-16",
               "application/jsonx", "image/png"):
        send("Content-Type", "POST", C, content=json.dumps(good), headers={"Content-Type": ct, **AUTH},
             ok=(200, 400, 415, 422))
    send("Content-Type", "POST", C, content=json.dumps(good).encode("utf-16"),
         headers={"Content-Type": "application/json", **AUTH}, ok=(200, 400, 415, 422))
    # host header
    for host in ("evil.example.com", "localhost.evil.com", "", "127.0.0.1:1", "[::1]", "a" * 5000, "ä.com".encode("utf-8")):
        try:
            hdrs = {**J, "Host": host}
            send("Host header", "POST", C, content=json.dumps(good), headers=hdrs, ok=(200, 400, 403, 421))
            send("Host header", "GET", "/health", headers={"Host": host}, ok=(200, 400, 403, 421))
        except Exception:
            pass
    # unknown model
    for m in ("gpt-4", "", "TINY-LLAMA", "tiny-llama ", "../etc/passwd", "a" * 10000, "tiny-llama\x00"):
        send("unknown model", "POST", C, json_body=dict(good, model=m), ok=(400, 404, 422))
        send("unknown model", "GET", "/v1/models/" + (urllib.parse.quote(m, safe="") or "x"),
             ok=(404, 400, 422))
    # auth
    for h in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "bearer " + KEY + "x"},
              {"Authorization": "Basic " + KEY}, {"Authorization": "Bearer"}, {"Authorization": "Bearer " + "k" * 10000},
              {"Authorization": "Bearer \u00e9"}, {"Authorization": ""}):
        hh = {"Content-Type": "application/json"}
        for k, v in h.items():
            hh[k] = v.encode("utf-8") if isinstance(v, str) else v
        send("auth", "POST", C, content=json.dumps(good), headers=hh, ok=(401, 400, 403))
        send("auth", "GET", "/v1/models", headers=hh, ok=(401, 400, 403))
        # /metrics is open by default (--metrics-require-key not given), so 200 is the expected answer
        send("auth", "GET", "/metrics", headers=hh, ok=(200,))
    # chat roles
    for msgs in ([{"role": "hacker", "content": "x"}], [{"role": "", "content": "x"}], [{"content": "x"}],
                 [{"role": "user"}], [], [{"role": "user", "content": None}], [{"role": "tool", "content": "x"}],
                 [{"role": "user", "content": "{{ raise_exception('x') }}"}], [{"role": 5, "content": "x"}],
                 [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                 "not a list", [[1]], [{"role": "user", "content": "x" * 100000}]):
        send("chat roles", "POST", CH, json_body={"model": "tiny-llama", "messages": msgs, "max_tokens": 3},
             ok=(200, 400, 413, 422))
    # streaming closed mid-stream
    for i in range(15):
        pos = os.path.getsize(err_path)
        tally.current = "stream closed early"
        path = C if i % 2 else CH
        body = (dict(good, max_tokens=60, stream=True, ignore_eos=True) if path == C else
                {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 60,
                 "stream": True, "ignore_eos": True})
        status = None
        try:
            with client.stream("POST", path, json=body, headers=J) as r:
                status = r.status_code
                for n, _ in enumerate(r.iter_bytes()):
                    if n >= i % 4:
                        break
        except Exception as exc:
            status = f"EXC:{type(exc).__name__}"
        time.sleep(0.05)
        ntb, _ = log_tracebacks(err_path, pos)
        tally.add("stream closed early", status, status == 200 and ntb == 0, f"stream {path} i={i}")
        if ntb:
            tally.traceback("stream closed early", f"stream {path} i={i}")
    # 1 MB bodies
    for body in ('{"model":"tiny-llama","prompt":"' + "a" * (1 << 20) + '","max_tokens":1}',
                 '{"model":"tiny-llama","prompt":"a","max_tokens":1,"user":"' + "u" * (1 << 20) + '"}',
                 "x" * (1 << 20), "[" * (1 << 20), '{"model":"tiny-llama","messages":[' +
                 ",".join(['{"role":"user","content":"a"}'] * 35000) + "]}",
                 '{"model":"tiny-llama","prompt":[' + ",".join(["5"] * 300000) + '],"max_tokens":1}'):
        send("1 MB bodies", "POST", CH if "messages" in body else C, content=body, ok=(400, 413, 422))
    # issue 27: each case with the answer the test expects
    for case, path, body, statuses, _ in issue_27_cases():
        send("issue 27", "POST", path, json_body={**body, "model": "tiny-llama"}, ok=statuses)
    # health and a normal completion at the end
    for _ in range(3):
        send("health / final sanity", "GET", "/health", headers={}, ok=(200,))
    st = send("health / final sanity", "POST", C, json_body=good, ok=(200,))
    send("health / final sanity", "POST", CH, json_body={"model": "tiny-llama", "max_tokens": 4,
                                                         "messages": [{"role": "user", "content": "hi"}]}, ok=(200,))
    client.close()
    return st


# ---------------------------------------------------------------- CLI
def run_cli(model: str, root: str, tally: Tally):
    def variant(name, edit=None, remove=(), files=None):
        d = os.path.join(root, "bad-" + name)
        shutil.copytree(model, d)
        if edit is not None:
            cfg = json.load(open(os.path.join(d, "config.json")))
            r = edit(cfg)
            text = r if isinstance(r, str) else json.dumps(cfg)
            open(os.path.join(d, "config.json"), "w").write(text)
        for f in remove:
            os.remove(os.path.join(d, f))
        for f, content in (files or {}).items():
            open(os.path.join(d, f), "wb").write(content if isinstance(content, bytes) else content.encode())
        return d

    def setk(k, v):
        return lambda c: c.__setitem__(k, v)

    def setrope(k, v):  # transformers 5 folders keep rope_theta/rope_type under rope_parameters
        return lambda c: c.setdefault("rope_parameters", {}).__setitem__(k, v)

    cases = [
        ("rope_theta-x", setrope("rope_theta", "x")), ("rms_norm_eps-neg", setk("rms_norm_eps", -1)),
        ("tie-str", setk("tie_word_embeddings", "false")), ("hidden-1e12", setk("hidden_size", 10 ** 12)),
        ("heads-0", setk("num_attention_heads", 0)), ("layers-neg", setk("num_hidden_layers", -2)),
        ("vocab-str", setk("vocab_size", "320")), ("kvheads-3", setk("num_key_value_heads", 3)),
        ("nested-10000", lambda c: '{"a":' * 10000 + "1" + "}" * 10000),
        ("config-array", lambda c: "[1,2]"), ("config-trunc", lambda c: '{"hidden_size": 6'),
        ("rope_theta-nan", setrope("rope_theta", float("nan"))), ("arch-unknown", setk("architectures", ["FooForCausalLM"])),
        ("maxpos-huge", setk("max_position_embeddings", 10 ** 30)),
        ("rope-llama3-factor-x", lambda c: c.__setitem__("rope_parameters", {"rope_theta": 1e4, "rope_type": "llama3",
                                                                              "factor": "x"})),
        ("rope-type-unknown", setrope("rope_type", "warp")),
        ("rope_theta-toplevel-x", setk("rope_theta", "x")),  # shadowed by rope_parameters
    ]
    folders = [(n, variant(n, e)) for n, e in cases]
    folders += [
        ("no-config", variant("no-config", remove=["config.json"])),
        ("no-weights", variant("no-weights", remove=["model.safetensors"])),
        ("no-tokenizer", variant("no-tokenizer", remove=["tokenizer.json"])),
        ("index-malformed", variant("index-malformed", remove=["model.safetensors"],
                                    files={"model.safetensors.index.json": '{"weight_map": [1,2'})),
        ("index-wrongtype", variant("index-wrongtype", remove=["model.safetensors"],
                                    files={"model.safetensors.index.json": '{"weight_map": {"a": 5}}'})),
        ("index-escape", variant("index-escape", remove=["model.safetensors"],
                                 files={"model.safetensors.index.json": '{"weight_map": {"model.embed_tokens.weight": "../../etc/passwd"}}'})),
        ("weights-garbage", variant("weights-garbage", files={"model.safetensors": b"\xff" * 64})),
        ("weights-empty", variant("weights-empty", files={"model.safetensors": b""})),
        ("tokenizer-garbage", variant("tokenizer-garbage", files={"tokenizer.json": "{not json"})),
        ("missing-folder", os.path.join(root, "does-not-exist")),
    ]
    gen = ["generate", "--device", "cpu", "--dtype", "float32", "--max-model-len", "64",
           "--num-gpu-blocks-override", "16", "--prompt", "Hello", "--max-tokens", "2"]
    runs = []
    config_ok = ("no-weights", "no-tokenizer", "index-malformed", "index-wrongtype", "index-escape",
                 "weights-garbage", "weights-empty", "tokenizer-garbage", "rope_theta-toplevel-x")
    for name, d in folders:
        # plan reads config.json only, so a folder whose config.json is fine may plan (exit 0) or refuse (exit 2)
        runs.append((f"corrupt folder: {name}", ["plan", d, "--device-memory", "80GiB"],
                     (0, 2) if name in config_ok else 2))
        # generate passes --max-model-len 64, which a huge max_position_embeddings allows: it may run
        runs.append((f"corrupt folder: {name}", gen[:1] + [d] + gen[1:], (0, 2) if name == "maxpos-huge" else 2))
    for flags in (["--seed", str(2 ** 64)], ["--seed", "-1"], ["--block-size", "3"], ["--block-size", "0"],
                  ["--max-model-len", "0"], ["--max-model-len", "9" * 400], ["--temperature", "nan"],
                  ["--max-tokens", "-5"], ["--prompt-token-ids", "1,99999"], ["--prompt-token-ids", "a,b"],
                  ["--dtype", "int3"], ["--device", "tpu9"], ["--num-gpu-blocks-override", "-1"]):
        runs.append(("bad flags (generate)", gen[:1] + [model] + gen[1:] + flags, 2))
    for flags in (["--device-memory", "1e400"], ["--device-memory", "-5GiB"], ["--device-memory", "nanGiB"],
                  ["--block-size", "3"], ["--gpu", "TPU"], ["--gpu-memory-utilization", "2"],
                  ["--tensor-parallel-size", "0"], ["--max-model-len", "0"], ["--kv-cache-memory", "1e400"]):
        runs.append(("bad flags (plan)", ["plan", model] + flags, 2))
    runs.append(("valid CLI (control)", ["plan", model, "--device-memory", "80GiB"], 0))
    # top-level rope_theta "x" next to a good rope_parameters is shadowed: expected to run (exit 0) or refuse

    runs.append(("valid CLI (control)", gen[:1] + [model] + gen[1:], 0))

    def one(run):
        cat, argv, want = run
        p = subprocess.run([sys.executable, "-m", "kvfit.cli"] + argv, capture_output=True, text=True, timeout=120,
                           errors="replace")
        return cat, argv, want, p
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(2) as ex:
        for cat, argv, want, p in ex.map(one, runs):
            group = cat.split(":")[0]
            tb = "Traceback" in p.stderr
            errs = [l for l in p.stderr.splitlines() if l.startswith("error:")]
            if p.returncode == 2 and want in (2, (0, 2)):
                clean = len(errs) == 1 and not tb
            else:
                clean = want in (0, (0, 2)) and p.returncode == 0 and not tb
            short = " ".join(a if len(a) < 60 else a[:40] + "..." for a in argv)
            tally.add(group, f"exit {p.returncode}", clean,
                      f"{cat}: kvfit {short} -> {p.stderr.strip().splitlines()[-1:] if p.stderr.strip() else ''}")
            if tb:
                tally.traceback(group, f"{cat}: kvfit {short}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", action="store_true", help="keep the temp folder (model, server log)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="send the HTTP attacks this many times to the same server; the server's memory after each "
                         "round is reported (a plateau after the first: caches filled, nothing leaking)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    t0 = time.time()
    root = tempfile.mkdtemp(prefix="kvfit-adv-")
    model = make_tiny_llama(root)
    tally = Tally()
    proc, url, err_path, out_lines = start_server(model, root)
    try:
        probe = Probe(url, proc.pid, tally)
        probe.start()
        memory_by_round = []
        for _ in range(args.rounds):
            run_http(url, err_path, tally, rng)
            memory_by_round.append(f"{probe.rss():.0f}")
        health_ok = httpx.get(url + "/health", timeout=10).status_code == 200
        probe_lines = probe.finish()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "killed after 60 s"
    server_tb = open(err_path, errors="replace").read().count("Traceback")
    tally.add("SIGTERM shutdown", f"exit {rc}", rc == 0 and server_tb == 0, "serve exit after SIGTERM")
    run_cli(model, root, tally)

    lines = [f"kvfit adversarial run, seed {args.seed}, {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, "
             f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, {time.time() - t0:.0f} s", ""]
    hdr = f"{'category':<26} {'tried':>6} {'clean':>6} {'5xx':>4} {'tracebacks':>10}  status codes / exit codes"
    lines += [hdr, "-" * len(hdr)]
    tot = {"n": 0, "clean": 0, "5xx": 0, "tb": 0}
    for cat, r in tally.rows.items():
        for k in tot:
            tot[k] += r[k]
        codes = ", ".join(f"{c}x{n}" for c, n in sorted(r["codes"].items()))
        lines.append(f"{cat:<26} {r['n']:>6} {r['clean']:>6} {r['5xx']:>4} {r['tb']:>10}  {codes}")
    lines += ["-" * len(hdr), f"{'TOTAL':<26} {tot['n']:>6} {tot['clean']:>6} {tot['5xx']:>4} {tot['tb']:>10}", "",
              f"server log tracebacks total: {server_tb}; /health 200 at end: {health_ok}; serve exit after SIGTERM: {rc}",
              *probe_lines,
              f"server memory after each of {args.rounds} round(s) of the HTTP attacks: "
              f"{', '.join(memory_by_round)} MiB",
              "", f"not handled cleanly ({len(tally.failures)} shown):"]
    lines += ["  " + f for f in tally.failures] or ["  none"]
    if server_tb:
        lines += ["", "first server traceback:"]
        txt = open(err_path, errors="replace").read()
        i = txt.find("Traceback")
        lines += ["  " + l for l in txt[i:i + 3000].splitlines()[:40]]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        open(args.out, "w").write(text)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"kept {root}")


if __name__ == "__main__":
    main()
