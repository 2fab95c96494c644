"""The HTTP front-end's memory while clients do not read their streams, against the same streams read (CPU).

Starts `kvfit serve` on a tiny random Llama (tests/tools/adversarial.py's), opens N streaming completions of L
tokens with `logprobs` K, and samples the front-end process's resident memory until they finish: once with
clients that never read (a 2 KiB receive buffer, the socket stays full), once with clients that read. Reports the
peak growth of each (medians of --reps runs, and their spread) and the ratio. A stream's unread outputs wait in
one slot (RequestStream), so the ratio stays near 1; a queue of cumulative outputs made it grow with the square
of the length.

    python3 benchmarks/bench_slow_readers.py --streams 4 --tokens 4000 --logprobs 20 --reps 2
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
sys.path.insert(0, os.path.join(TESTS, "tools"))


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


def _serve(model: str, max_len: int, streams: int):
    proc = subprocess.Popen([sys.executable, "-m", "kvfit.cli", "serve", model, "--device", "cpu", "--dtype", "float32",
                             "--max-model-len", str(max_len), "--num-gpu-blocks-override", str(max_len * streams // 8),
                             "--max-num-seqs", str(streams + 2), "--port", "0", "--served-model-name", "tiny",
                             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.time() + 180
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if "listening on " in line:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, line.split("listening on ", 1)[1].split()[0].rstrip("/")
    proc.kill()
    raise SystemExit("kvfit serve did not start")


def _generated(url: str) -> float:
    """Output tokens of the requests the engine has finished."""
    return sum(float(line.split()[-1]) for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
               if line.startswith("kvfit_generation_tokens_total"))


def run_once(model: str, args, read: bool) -> float:
    """Peak front-end RSS growth (MiB) while the streams run."""
    proc, url = _serve(model, args.tokens + 64, args.streams)
    try:
        host, port = url.removeprefix("http://").split(":")
        base = _rss_mib(proc.pid)
        body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": args.tokens, "ignore_eos": True,
                           "stream": True, "logprobs": args.logprobs}).encode()
        socks = []
        for _ in range(args.streams):
            sock = socket.socket()
            if not read:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
            sock.connect((host, int(port)))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            socks.append(sock)
        if read:
            for sock in socks:
                threading.Thread(target=lambda s=sock: [None for _ in iter(lambda: s.recv(1 << 16), b"")],
                                 daemon=True).start()
        peak, deadline = base, time.time() + args.timeout
        while time.time() < deadline:       # until every token is made (a client that does not read holds its
            time.sleep(0.2)                 # outputs in the front-end from then on), then a second more
            peak = max(peak, _rss_mib(proc.pid))
            if _generated(url) >= args.streams * args.tokens:
                time.sleep(1)
                peak = max(peak, _rss_mib(proc.pid))
                break
        for sock in socks:
            sock.close()
        return peak - base
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--logprobs", type=int, default=20)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args()
    from adversarial import make_tiny_llama
    model = make_tiny_llama(tempfile.mkdtemp(prefix="kvfit-slow-readers-"))
    # the tiny model's 512 positions: widen them for long streams (random weights, no trained range to keep)
    config_path = os.path.join(model, "config.json")
    config = json.load(open(config_path))
    config["max_position_embeddings"] = args.tokens + 64
    json.dump(config, open(config_path, "w"))
    growth = {}
    for read in (True, False):
        runs = [run_once(model, args, read) for _ in range(args.reps)]
        growth[read] = runs
        med = statistics.median(runs)
        spread = (max(runs) - min(runs)) / med if med else 0.0
        print(f"{'reading' if read else 'not reading'}: front-end RSS growth {med:.0f} MiB median of "
              f"{[round(r) for r in runs]} (spread {spread:.0%})", flush=True)
    ratio = statistics.median(growth[False]) / max(statistics.median(growth[True]), 1.0)
    print(f"{args.streams} streams x {args.tokens} tokens, logprobs {args.logprobs}: not reading / reading = "
          f"{ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
