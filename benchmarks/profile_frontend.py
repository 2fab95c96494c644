"""What `kvfit serve`'s HTTP front-end costs per streamed token, without a GPU (issue 31: where the time goes).

python benchmarks/profile_frontend.py [--model qwen3-0.6b] [--streams 256] [--tokens 256] [--step-ms 10] [--py-spy]
                                     [--stack-samples DIR] [--http-parser auto|httptools|h11]
                                     [--event-loop auto|uvloop|asyncio]

A server process runs the real front-end (the app, EngineCoreClient, FrontEndText's incremental detokenizing,
response building, SSE) in front of an engine core process whose engine is the tests' stand-in
(tests/server/fake_engine.py: every step sleeps --step-ms, then gives each running request one token): no model,
so the core costs little and the front-end's share is what is measured. The model folder is bench_serve.py's (a
catalog config and a word-level tokenizer over the whole vocabulary). The client is bench_serve.py's, in this
process: --streams streaming /v1/completions requests at once, each --tokens tokens long.

Reports the CPU microseconds per output token of the server process (the front-end) and of its child (the core),
read from /proc: 1e6 / the front-end's figure is how many tokens a second one front-end process carries at a whole
core. One token per delta is the worst case for the per-delta costs (on a GPU a round brings up to 8).
--py-spy (py-spy installed) samples the front-end process for the middle of the run and prints its hottest
functions (self time) and the share of samples under each of its main entry points. --stack-samples DIR has both
server processes sample themselves (kvfit's stack sampler, $KVFIT_STACK_SAMPLES: no ptrace) over the whole
last run, and prints bench_serve.py's per-process summary, then the front-end's shares under the same entry points.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
sys.path.insert(0, HERE)


def serve(folder: str, port_file: str, streams: int, step_ms: float, parser: str, loop: str, gc_tuned: bool) -> None:
    """The server process: the front-end in front of a stand-in engine core, its HTTP served from the main thread as
    `kvfit serve` serves it (the stack sampler samples the main thread); writes its port, serves until a SIGTERM."""
    sys.path[:0] = [TESTS, os.path.join(TESTS, "server")]
    from fake_engine import FakeEngine

    from kvfit.server.app import create_app
    from kvfit.server.core_process import EngineCoreClient
    from kvfit.server.gc_tuning import tune_gc_after_startup
    from kvfit.server.launch import ConnectionLimits, GuardOptions, bind_socket, install_guards
    from kvfit.server.launch import serve as serve_http
    from kvfit.text.tokenizer import load_tokenizer
    factory = functools.partial(FakeEngine, max_model_len=4096, max_running=streams, step_seconds=step_ms / 1e3)
    client = EngineCoreClient.launch(factory, tokenizer=load_tokenizer(folder), generation_config="vllm",
                                     model_folder=folder, max_waiting_requests=16 * streams, log_level="warning")
    try:
        limits = ConnectionLimits(max_connections=None, http_parser=parser, event_loop=loop)
        app = create_app(client, "bench")
        install_guards(app, GuardOptions("127.0.0.1"))
        sock = bind_socket("127.0.0.1", 0)          # listening: requests wait in its backlog until uvicorn runs
        with open(port_file, "w") as f:
            f.write(str(sock.getsockname()[1]))
        if gc_tuned:                                 # as kvfit serve does once it serves
            tune_gc_after_startup("HTTP front-end")
        serve_http(app, sock, client.begin_shutdown, log_level="warning", limits=limits, dead_reason=client.check_dead)
    finally:
        client.stop()


def hottest(stacks, top: int = 15) -> list[str]:
    """(frames, count) collapsed stacks (py-spy's raw lines: bench_serve.spy_stacks) -> lines: the functions with the
    most self samples, then the share of samples under a few entry points of the front-end."""
    self_samples, total = collections.Counter(), 0
    under = collections.Counter()
    # py-spy names a frame "Class.function (path:line)"
    marks = {"detokenizing (FrontEndText.extend)": "FrontEndText.extend", "folding deltas (OutputAccumulator)":
             "OutputAccumulator.apply", "response building (responses.py)": "server/responses.py",
             "SSE framing": "sse (kvfit/server/protocol.py", "uvicorn and h11": "h11",
             "socket writes": "SocketTransport.write",
             "reading the core (EngineCoreClient._read)": "EngineCoreClient._read", "json": "json/"}
    for frames, n in stacks:
        total += n
        self_samples[frames[-1]] += n
        for name, needle in marks.items():
            if any(needle in frame for frame in frames):
                under[name] += n
    total = total or 1
    lines = [f"{n / total:6.1%}  {frame}" for frame, n in self_samples.most_common(top)]
    lines.append("under: " + ", ".join(f"{name} {n / total:.1%}" for name, n in under.most_common()))
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b", help="a catalog name: its config and vocabulary size")
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256, help="output tokens per request")
    ap.add_argument("--step-ms", type=float, default=10.0, help="the stand-in engine's step time")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--py-spy", action="store_true")
    ap.add_argument("--stack-samples", default=None, metavar="DIR",
                    help="the server's processes sample their own stacks into DIR (no ptrace); summary of the last run")
    ap.add_argument("--http-parser", default="auto", choices=["auto", "httptools", "h11"])
    ap.add_argument("--event-loop", default="auto", choices=["auto", "uvloop", "asyncio"])
    ap.add_argument("--default-gc", action="store_true", help="leave the front-end's garbage collector at "
                                                               "CPython's defaults (kvfit serve tunes it)")
    ap.add_argument("--serve", nargs=2, metavar=("FOLDER", "PORT_FILE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(*args.serve, args.streams, args.step_ms, args.http_parser, args.event_loop, not args.default_gc)
        return 0
    from bench_serve import (children, make_folder, make_requests, median_spread, print_stacks, process_cpu, run_load,
                             sampled_since, sampled_stacks, spy_stacks)
    root = tempfile.mkdtemp(prefix="kvfit-frontend-")
    folder = make_folder(args.model, root)
    vocab = json.load(open(os.path.join(folder, "config.json")))["vocab_size"]
    port_file = os.path.join(root, "port")
    server = subprocess.Popen([sys.executable, __file__, "--streams", str(args.streams), "--step-ms",
                               str(args.step_ms), "--http-parser", args.http_parser, "--event-loop", args.event_loop,
                               *(["--default-gc"] if args.default_gc else []), "--serve", folder, port_file],
                              start_new_session=True,
                              env={**os.environ, **({"KVFIT_STACK_SAMPLES": os.path.abspath(args.stack_samples)}
                                                    if args.stack_samples else {})})
    try:
        while not os.path.exists(port_file) or not open(port_file).read():
            if server.poll() is not None:
                raise SystemExit(f"the server exited with {server.returncode}")
            time.sleep(0.2)
        port = int(open(port_file).read())
        requests = make_requests("random", args.streams, vocab, (16, 64), (args.tokens, args.tokens), seed=0)
        asyncio.run(run_load(port, requests[:16], float("inf"), None, 0))            # warm-up
        rows = []
        for run in range(args.runs):
            spy = None
            if args.py_spy and run == args.runs - 1:
                raw = os.path.join(root, "frontend.txt")
                spy = subprocess.Popen(["py-spy", "record", "-p", str(server.pid), "-d", "8", "-r", "200", "-f",
                                        "raw", "-o", raw, "--nonblocking"], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
            pids = {server.pid, *children(server.pid)} if args.stack_samples and run == args.runs - 1 else set()
            stacks_before = sampled_stacks(args.stack_samples, pids) if pids else None
            before = process_cpu(server.pid)
            summary = asyncio.run(run_load(port, requests, float("inf"), None, seed=run))
            after = process_cpu(server.pid)
            tokens = summary["out_tok_s"] * summary["duration_s"]
            row = {"out_tok_s": summary["out_tok_s"], "errors": summary["errors"],
                   "frontend_cpu_us_per_token": (after[0] - before[0]) / tokens * 1e6,
                   "core_cpu_us_per_token": (after[1] - before[1]) / tokens * 1e6,
                   "health_p99_ms": summary["health_p99_ms"], "itl_p50_ms": summary["itl_p50_ms"]}
            rows.append(row)
            print(f"run {run}: " + json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}),
                  flush=True)
            if spy is not None:
                spy.wait(60)
                if os.path.exists(raw):
                    print("front-end, py-spy (self samples):\n  " + "\n  ".join(hottest(spy_stacks(raw))))
            if pids:
                stacks = sampled_since(args.stack_samples, pids, stacks_before)
                print_stacks(stacks, "stack samples")
                frontend = [(frames, n) for frames, n in stacks if frames[0].startswith("process kvfit-frontend ")]
                print("front-end, stack samples (self samples):\n  " + "\n  ".join(hottest(frontend)))
        fe, spread = median_spread([r["frontend_cpu_us_per_token"] for r in rows])
        print(f"RESULT front-end {fe:.1f} us/token (spread {spread:.0%}): one front-end process carries about "
              f"{1e6 / fe:,.0f} tok/s at a whole core; core {median_spread([r['core_cpu_us_per_token'] for r in rows])[0]:.1f}"
              f" us/token; {args.streams} streams x {args.tokens} tokens, one token per delta")
    finally:
        os.killpg(server.pid, 15)
        server.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
