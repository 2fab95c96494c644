"""`kvfit serve` against `vllm serve` under HTTP load, in the conventions of `vllm bench serve`.

Each server runs in its own process on the same model folder: a catalog config (dummy bf16 weights)
and a word-level tokenizer whose every id decodes to a word, so the text paths (detokenizing, stop
checks, SSE framing) do real work; a chat template for the chat dataset. The client is plain asyncio
(no HTTP library: it runs wherever Python does), one connection per request, streaming.

Datasets: `random` (token-id prompts to /v1/completions, lengths drawn from --input-len and
--output-len, greedy, ignore_eos, usage included) and `chat` (word prompts to /v1/chat/completions).
Rates: `inf` (every request at once) or a Poisson rate in requests/s; --max-concurrency caps requests
in flight. Every (rate, run) sends its own requests, the same for every engine (a repeat would find its prompts in
the prefix cache). While requests run, /health is probed every 50 ms from a process of its own (its latency is
reported; the load's client, busy with thousands of streams, adds nothing to it).

Reports per engine and row: request throughput, output tok/s, TTFT, TPOT and ITL p50/p90/p99, errors,
/health p99, the mean of each engine phase of a request from the server's own vllm:request_{queue,prefill,
decode,inference}_time_seconds histograms (TTFT less queue + prefill is what the HTTP side and the IPC add), and
CPU microseconds per output token of the server process (HTTP, tokenizing, detokenizing, SSE) and of its
children (the engine core): 1e6 / the front-end's figure is what one front-end process could
carry; medians over --runs (spread = (max - min) / median) and the kvfit / vllm ratio.

  python3 benchmarks/bench_serve.py --model qwen3-0.6b --num-requests 512 --rates inf --runs 2
  python3 benchmarks/bench_serve.py --model qwen3-0.6b --engines kvfit --num-requests 2000 --rates inf
  python3 benchmarks/bench_serve.py --model qwen3-0.6b --engines kvfit,offline --rates inf

--py-spy DIR samples each server process with py-spy (it needs ptrace) for 8 s of each rate's last run; --stack-samples
DIR has `kvfit serve`'s own processes sample themselves (src/kvfit/server/stack_sampler.py: $KVFIT_STACK_SAMPLES, no
ptrace; vLLM is not sampled) over the whole of each rate's last run. Either prints, per process, its share of the
samples (the sampler's are CPU time), its hottest functions (self time) and kvfit's functions with the most samples
under them.

Engine `offline` is kvfit's `LLM.generate` on the same requests (random dataset: their token ids, greedy,
ignore_eos, the same max_tokens), in a child process with the same flags: the serving / offline ratio is
what the server costs on top of the engine.
vLLM: ../shared/peers/vllm (PYTHONPATH with its site/ and deps/); without it the vllm rows are skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing
import os
import shutil
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")


# the model folder ----------------------------------------------------------------------------------
def make_folder(model: str, root: str) -> str:
    """A catalog config plus a word-level tokenizer covering the whole vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from kvfit.catalog import model_config
    config = dict(model_config(model))
    config.setdefault("torch_dtype", "bfloat16")
    vocab_size = config["vocab_size"]
    folder = os.path.join(root, model)
    os.makedirs(folder, exist_ok=True)
    specials = ["<unk>", "<|user|>", "<|assistant|>", "<|system|>", "<eos>"]
    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)    # joins words with spaces
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    config["eos_token_id"] = vocab["<eos>"]
    config.pop("bos_token_id", None)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "eos_token": "<eos>",
                   "chat_template": CHAT_TEMPLATE, "model_max_length": 1 << 20}, f)
    return folder


# requests -----------------------------------------------------------------------------------------
def make_requests(dataset: str, num: int, vocab_size: int, in_range, out_range, seed: int) -> list[dict]:
    rng = random.Random(seed)
    requests = []
    for _ in range(num):
        num_in, num_out = rng.randint(*in_range), rng.randint(*out_range)
        common = {"model": "bench", "max_tokens": num_out, "temperature": 0.0, "ignore_eos": True, "stream": True,
                  "stream_options": {"include_usage": True}}
        ids = [rng.randrange(5, vocab_size) for _ in range(num_in)]
        if dataset == "random":
            requests.append({"path": "/v1/completions", "body": {**common, "prompt": ids}, "num_out": num_out})
        else:
            text = " ".join(f"w{i}" for i in ids[:max(num_in - 4, 1)])
            requests.append({"path": "/v1/chat/completions", "num_out": num_out,
                             "body": {**common, "messages": [{"role": "user", "content": text}]}})
    return requests


async def _http(port: int, method: str, path: str, body: bytes | None):
    """(status, an async iterator of body pieces) over one HTTP/1.1 connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n"
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    writer.write(head.encode() + b"\r\n" + (body or b""))
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    chunked = False
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        chunked |= name.strip().lower() == "transfer-encoding" and "chunked" in value.lower()

    async def pieces():
        try:
            if not chunked:
                yield await reader.read()
                return
            while True:
                size = int((await reader.readline()).strip() or b"0", 16)
                if size == 0:
                    return
                yield await reader.readexactly(size)
                await reader.readline()
        finally:
            writer.close()
    return status, pieces()


async def one_request(port: int, request: dict) -> dict:
    start = time.perf_counter()
    result = {"ok": False, "ttft": None, "itl": [], "latency": None, "output_tokens": 0}
    try:
        status, pieces = await _http(port, "POST", request["path"], json.dumps(request["body"]).encode())
        buffer, last = b"", None
        async for piece in pieces:
            buffer += piece
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                data = event.decode().removeprefix("data: ").strip()
                if status != 200 or data == "[DONE]" or not data:
                    continue
                chunk = json.loads(data)
                if chunk.get("usage") and not chunk.get("choices"):
                    result["output_tokens"] = chunk["usage"]["completion_tokens"]
                    continue
                choice = (chunk.get("choices") or [{}])[0]
                text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                if text:
                    now = time.perf_counter()
                    if last is None:
                        result["ttft"] = now - start
                    else:
                        result["itl"].append(now - last)
                    last = now
        result["ok"] = status == 200 and result["output_tokens"] == request["num_out"]
        result["status"] = status
    except (OSError, ValueError, asyncio.IncompleteReadError) as exc:
        result["status"] = repr(exc)[:80]
    result["latency"] = time.perf_counter() - start
    return result


async def health_status(port: int) -> int:
    """One GET /health, read to the end: its status (0: no answer)."""
    try:
        status, pieces = await _http(port, "GET", "/health", None)
        async for _ in pieces:
            pass
        return status
    except (OSError, ValueError, IndexError, asyncio.IncompleteReadError):
        return 0


def probe_health(port: int, stop, out) -> None:
    """A process of its own: /health every 50 ms until `stop` is set, then (latency s, status) pairs sent to
    `out`. Apart from the load's client, so its event loop (parsing thousands of streams) adds nothing to the
    figure: what is measured is how long the server takes to answer."""
    async def probes() -> list[tuple[float, int]]:
        latencies = []
        while not stop.is_set():
            start = time.perf_counter()
            status = await health_status(port)
            latencies.append((time.perf_counter() - start, status))
            await asyncio.sleep(0.05)
        return latencies

    out.send(asyncio.run(probes()))
    out.close()


async def run_load(port: int, requests: list[dict], rate: float, max_concurrency: int | None, seed: int) -> dict:
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency or len(requests))
    context = multiprocessing.get_context("spawn")
    stop, (receive, send) = context.Event(), context.Pipe(duplex=False)
    prober = context.Process(target=probe_health, args=(port, stop, send), daemon=True)
    prober.start()
    send.close()

    async def limited(request):
        async with limit:
            return await one_request(port, request)

    start = time.perf_counter()
    tasks = []
    for request in requests:
        tasks.append(asyncio.create_task(limited(request)))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    stop.set()
    health = receive.recv() if receive.poll(60) else []
    prober.join(10)
    return summarize(results, duration, health)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def summarize(results: list[dict], duration: float, health: list) -> dict:
    ok = [r for r in results if r["ok"]]
    tokens = sum(r["output_tokens"] for r in ok)
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    tpot = [(r["latency"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok
            if r["ttft"] is not None and r["output_tokens"] > 1]
    itl = [x for r in ok for x in r["itl"]]
    errors = {}
    for r in results:
        if not r["ok"]:
            errors[str(r.get("status"))] = errors.get(str(r.get("status")), 0) + 1
    out = {"requests": len(results), "completed": len(ok), "errors": errors, "duration_s": duration,
           "req_s": len(ok) / duration, "out_tok_s": tokens / duration,
           "health_p99_ms": (_pct([h[0] for h in health], 99) or 0) * 1e3,
           "health_not_200": sum(1 for h in health if h[1] != 200)}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        for q in (50, 90, 99):
            value = _pct(values, q)
            out[f"{name}_p{q}_ms"] = None if value is None else value * 1e3
    return out


PHASES = ("queue", "prefill", "decode", "inference")
RELEASES_METRIC = "kvfit:allocator_cache_releases_total"     # keep_within's releases (a device sync each)


def phase_sums(port: int) -> dict[str, float]:
    """metric_sums of the server's /metrics now; {} where it cannot be read."""
    try:
        return metric_sums(asyncio.run(_get_text(port, "/metrics")))
    except OSError:
        return {}


def metric_sums(text: str) -> dict[str, float]:
    """{'queue_sum': s, 'queue_count': n, ...} from a /metrics text's vllm:request_*_time_seconds histograms (both
    servers expose them: the engine's own stage times of each finished request), and kvfit's allocator cache
    releases so far ('cache_releases', where it counts them)."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(RELEASES_METRIC + " "):        # kvfit only (a CUDA engine in the core process)
            sums["cache_releases"] = float(line.rsplit(" ", 1)[1])
        for phase in PHASES:
            for part in ("sum", "count"):
                if line.startswith(f"vllm:request_{phase}_time_seconds_{part}"):
                    key = f"{phase}_{part}"
                    sums[key] = sums.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return sums


async def _get_text(port: int, path: str) -> str:
    """The body of GET path ('' unless 200)."""
    status, pieces = await _http(port, "GET", path, None)
    body = b"".join([piece async for piece in pieces])
    return body.decode() if status == 200 else ""


def phase_means_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean ms of each engine phase over the requests that finished between two scrapes, and the allocator
    cache releases between them (kvfit)."""
    means = {}
    if "cache_releases" in after and "cache_releases" in before:     # (a failed scrape gives no figure)
        means["cache_releases"] = after["cache_releases"] - before["cache_releases"]
    for phase in PHASES:
        count = after.get(f"{phase}_count", 0.0) - before.get(f"{phase}_count", 0.0)
        if count > 0:
            means[f"{phase}_mean_ms"] = (after[f"{phase}_sum"] - before.get(f"{phase}_sum", 0.0)) / count * 1e3
    return means


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (Linux /proc; its threads, not its children)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()        # fields 3.. of proc(5): utime is 14, stime 15
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except OSError:
                pass
    return found


def process_cpu(pid: int) -> tuple[float, float]:
    """(CPU seconds of the server process, of its children: kvfit's engine core, vLLM's EngineCore)."""
    return cpu_seconds(pid), sum(cpu_seconds(child) for child in children(pid))


def start_spy(folder: str, pid: int, name: str) -> tuple[subprocess.Popen, str]:
    """py-spy sampling the server and its children (the engine core) for 8 s from 1 s into the run."""
    os.makedirs(folder, exist_ok=True)
    raw = os.path.join(folder, f"{name}.txt")
    spy = shutil.which("py-spy")
    if spy is None:
        raise SystemExit("--py-spy: no py-spy on PATH (pip install py-spy; a --target install puts it in TARGET/bin)")
    command = f"sleep 1; exec {spy} record -p {pid} --subprocesses -d 8 -r 100 -f raw -o {raw} --nonblocking"
    with open(f"{raw}.err", "w") as err:    # why py-spy wrote nothing, if it does not
        return subprocess.Popen(["sh", "-c", command], stdout=subprocess.DEVNULL, stderr=err), raw


def spy_stacks(raw: str):
    """py-spy's raw (collapsed) output: (frames, root first; sample count) per line."""
    with open(raw) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            if stack and count.isdigit():
                yield stack.split(";"), int(count)


def print_spy(spy: subprocess.Popen, raw: str, top: int = 12) -> None:
    """py-spy's summary of one run (print_stacks), once py-spy has written its file."""
    try:
        spy.wait(60)
    except subprocess.TimeoutExpired:
        spy.kill()
    if not os.path.exists(raw):
        err = open(f"{raw}.err").read().strip().splitlines() if os.path.exists(f"{raw}.err") else []
        print(f"py-spy wrote nothing ({raw}): {err[-1] if err else 'no message'}")
        return
    print_stacks(spy_stacks(raw), "py-spy", top)


def print_stacks(stacks, label: str, top: int = 12) -> None:
    """Per process (the process frames name it) of (frames, count) collapsed stacks: its share of samples, its
    hottest functions (self time) and kvfit's functions with the most samples under them."""
    per_process: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    inclusive: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for frames, count in stacks:
        # with --subprocesses a child's stacks sit under its parent's process frame, then its own
        process = [f for f in frames if f.startswith("process ")][-1:] or ["?"]
        per_process[process[0][:100]][frames[-1][:110]] += count
        for function in {re.sub(r":\d+\)$", ")", frame) for frame in frames if "kvfit/" in frame}:
            inclusive[process[0][:100]][function[:110]] += count
    total = sum(sum(c.values()) for c in per_process.values()) or 1
    for process, counts in sorted(per_process.items(), key=lambda kv: -sum(kv[1].values())):
        n = sum(counts.values())
        print(f"{label} {process}: {n / total:.0%} of samples; self time:")
        for frame, k in counts.most_common(top):
            print(f"    {k / n:6.1%}  {frame}")
        print("  kvfit functions, inclusive:")
        for frame, k in inclusive[process].most_common(2 * top):
            print(f"    {k / n:6.1%}  {frame}")


def sampled_stacks(folder: str, pids: set[int]) -> collections.Counter:
    """kvfit's own stack sampler's counts (its files in folder, $KVFIT_STACK_SAMPLES) of the processes pids:
    {collapsed stack: CPU us}, read once every file has been rewritten after now (it rewrites them every FLUSH_S
    seconds). The files count from the start of serving: a window is two readings subtracted (sampled_since)."""
    from kvfit.server.stack_sampler import FLUSH_S, sample_files
    now, deadline = time.time(), time.time() + 3 * FLUSH_S
    while time.time() < deadline and any(os.path.getmtime(path) <= now for path in sample_files(folder, pids)):
        time.sleep(0.1)
    counts: collections.Counter = collections.Counter()
    for path in sample_files(folder, pids):
        for frames, count in spy_stacks(path):
            counts[";".join(frames)] += count
    return counts


def sampled_since(folder: str, pids: set[int], before: collections.Counter) -> list:
    """(frames, count) stacks the sampler counted since `before` (a sampled_stacks reading)."""
    return [(stack.split(";"), count) for stack, count in (sampled_stacks(folder, pids) - before).items()]


# offline ------------------------------------------------------------------------------------------
def offline_child(folder: str, requests_path: str, args) -> None:
    """In a child process: LLM.generate over the requests (after a warm-up), --runs times, with the engine flags
    `kvfit serve` gets here (server_command's); prints one JSON line per run with its output tok/s."""
    from kvfit import LLM, SamplingParams
    from kvfit.commands.flags import add_engine_flags, engine_kwargs
    flags = argparse.ArgumentParser()
    add_engine_flags(flags)
    serve_flags = server_command("kvfit", folder, 0, args)[5:]        # after `python -m kvfit.cli serve FOLDER`
    known, _ = flags.parse_known_args(serve_flags)
    with open(requests_path) as f:
        sets = json.load(f)           # {"warmup": [...], "runs": [[...] per run]}
    llm = LLM(folder, **engine_kwargs(known))

    def inputs(requests):
        return ([{"prompt_token_ids": r["body"]["prompt"]} for r in requests],
                [SamplingParams(temperature=0.0, max_tokens=r["num_out"], ignore_eos=True) for r in requests])

    llm.generate(*inputs(sets["warmup"]), use_tqdm=False)
    for requests in sets["runs"][:args.runs]:
        prompts, params = inputs(requests)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        duration = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print("OFFLINE " + json.dumps({"out_tok_s": tokens / duration, "duration_s": duration,
                                       "req_s": len(outs) / duration, "errors": {}}), flush=True)
    llm.shutdown()


def run_offline(folder: str, warmup: list[dict], request_sets: list[list[dict]], args, root: str) -> list[dict]:
    """kvfit's LLM.generate on the same requests (one set per run), in a child process (its GPU memory freed after)."""
    if args.dataset != "random":
        print("offline: only the random dataset (token ids) runs offline; skipped")
        return []
    path = os.path.join(root, "offline-requests.json")
    with open(path, "w") as f:
        json.dump({"warmup": warmup, "runs": request_sets}, f)
    command = [sys.executable, __file__, "--offline-child", folder, path, "--runs", str(args.runs),
               "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
               "--gpu-memory-utilization", str(args.gpu_memory_utilization), f"--kvfit-args={args.kvfit_args}"]
    done = subprocess.run(command, capture_output=True, text=True)
    runs = [json.loads(line[len("OFFLINE "):]) for line in done.stdout.splitlines() if line.startswith("OFFLINE ")]
    if done.returncode != 0 or not runs:
        print(f"offline: the child failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return runs


# servers ------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(engine: str, folder: str, port: int, args) -> list[str]:
    common = ["--port", str(port), "--max-model-len", str(args.max_model_len), "--max-num-seqs",
              str(args.max_num_seqs), "--load-format", "dummy", "--dtype", "bfloat16", "--enable-prefix-caching",
              "--served-model-name", "bench", "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if engine == "kvfit":
        return [sys.executable, "-m", "kvfit.cli", "serve", folder, "--log-level", "warning", *common,
                *args.kvfit_args.split()]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
            "--disable-uvicorn-access-log", *common]


def start_server(engine: str, folder: str, args, log_path: str):
    port = free_port()
    log = open(log_path, "w")
    env = dict(os.environ)
    if engine == "kvfit" and args.stack_samples:        # its front-end and engine core sample themselves
        env["KVFIT_STACK_SAMPLES"] = os.path.abspath(args.stack_samples)
    proc = subprocess.Popen(server_command(engine, folder, port, args), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, env=env)
    deadline = time.time() + args.start_timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{engine} server exited with {proc.returncode}; see {log_path}")
        if asyncio.run(health_status(port)) == 200:
            return proc, port, time.time() - (deadline - args.start_timeout)
        time.sleep(1)
    stop_server(proc)
    raise RuntimeError(f"{engine} server did not answer /health within {args.start_timeout} s; see {log_path}")


def stop_server(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def median_spread(values: list[float]) -> tuple[float, float]:
    med = statistics.median(values)
    return med, (max(values) - min(values)) / med if med else 0.0


def _apply_vllm_lengths(p: argparse.ArgumentParser, args) -> None:
    """vLLM bench serve's --random-input-len / --random-output-len (and --random-range-ratio) as --input-len and
    --output-len ranges: N when the ratio is 0, else from N(1 - R) to N(1 + R), as vLLM draws them."""
    if not 0 <= args.random_range_ratio < 1:
        p.error(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    for name in ("input", "output"):
        n = getattr(args, f"random_{name}_len")
        if n is None:
            continue
        if n < 1:
            p.error(f"--random-{name}-len must be at least 1, got {n}")
        lo, hi = max(1, round(n * (1 - args.random_range_ratio))), round(n * (1 + args.random_range_ratio))
        setattr(args, f"{name}_len", f"{lo},{hi}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--engines", default="kvfit,vllm")
    # vLLM bench serve's names work too: --dataset-name, --num-prompts, --request-rate, --random-input-len,
    # --random-output-len, --random-range-ratio, --result-filename
    p.add_argument("--dataset", "--dataset-name", choices=("random", "chat"), default="random")
    p.add_argument("--num-requests", "--num-prompts", type=int, default=512)
    p.add_argument("--rates", "--request-rate", default="inf", help="comma-separated: inf or requests/s (Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--input-len", default="128,1024", help="prompt lengths drawn from LO,HI (tokens)")
    p.add_argument("--output-len", default="128,512", help="output lengths drawn from LO,HI (tokens)")
    p.add_argument("--random-input-len", type=int, default=None,
                   help="vLLM's: prompts of this length (with --random-range-ratio R: from N(1-R) to N(1+R))")
    p.add_argument("--random-output-len", type=int, default=None, help="vLLM's: the same for outputs")
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--out", "--result-filename", default=None, help="write the JSON results here")
    p.add_argument("--kvfit-args", default="", help="more `kvfit serve` flags (e.g. '--device cpu')")
    p.add_argument("--py-spy", default=None, metavar="DIR",
                   help="sample each server and its children (py-spy, installed) for 8 s of each rate's last run; "
                        "raw stacks to DIR, the hottest functions of each process printed")
    p.add_argument("--stack-samples", default=None, metavar="DIR",
                   help="kvfit serve's processes sample their own stacks (no ptrace; $KVFIT_STACK_SAMPLES) into DIR; "
                        "the hottest functions of each over each rate's last run printed")
    p.add_argument("--offline-child", nargs=2, metavar=("FOLDER", "REQUESTS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    _apply_vllm_lengths(p, args)
    if args.offline_child:
        offline_child(*args.offline_child, args)
        return
    root = "/tmp/kvfit-bench-serve"
    os.makedirs(root, exist_ok=True)
    # a folder is used as it is (a CPU smoke run on a tiny model); a catalog name gets a built folder
    folder = args.model if os.path.isdir(args.model) else make_folder(args.model, root)
    vocab_size = json.load(open(os.path.join(folder, "config.json")))["vocab_size"]
    in_range = tuple(int(x) for x in args.input_len.split(","))
    out_range = tuple(int(x) for x in args.output_len.split(","))
    warmup = make_requests(args.dataset, 16, vocab_size, (32, 64), (8, 16), seed=1)
    rates = [float(r) for r in args.rates.split(",")]

    def request_set(rate_index: int, run: int) -> list[dict]:
        """Each (rate, run) its own requests, the same for every engine: both servers cache prefixes, so a run
        repeating an earlier run's prompts would find them cached (faster prefills than a first run)."""
        return make_requests(args.dataset, args.num_requests, vocab_size, in_range, out_range,
                             seed=1000 * rate_index + run + 2)

    results = {}
    for engine in args.engines.split(","):
        if engine == "offline":
            # the rate-inf row's request sets (the first rate's where inf is not asked for), run by run
            inf_index = rates.index(float("inf")) if float("inf") in rates else 0
            runs = run_offline(folder, warmup, [request_set(inf_index, run) for run in range(args.runs)], args, root)
            for i, run in enumerate(runs):
                print(f"offline {args.model} run {i}: " + json.dumps({k: round(v, 2) if isinstance(v, float) else v
                                                                     for k, v in run.items()}), flush=True)
            if runs:
                results[("offline", float("inf"))] = runs
            continue
        if engine == "vllm":
            try:
                import vllm  # noqa: F401
            except ImportError:
                print("vllm: not importable here; its rows are skipped")
                continue
        # the server's own log beside --out (it comes back from a device call with the results), else in root
        logs = os.path.dirname(os.path.abspath(args.out)) if args.out else root
        proc, port, startup = start_server(engine, folder, args, f"{logs}/{engine}-{os.path.basename(args.model)}.log")
        try:
            print(f"{engine}: up in {startup:.0f} s", flush=True)
            asyncio.run(run_load(port, warmup, float("inf"), None, 0))
            for rate_index, rate in enumerate(rates):
                runs = []
                for run in range(args.runs):
                    requests = request_set(rate_index, run)
                    cpu_before, phases_before = process_cpu(proc.pid), phase_sums(port)
                    last = run == args.runs - 1
                    spy = start_spy(args.py_spy, proc.pid, f"{engine}-{os.path.basename(args.model.rstrip('/'))}-{args.dataset}-{rate:g}") \
                        if args.py_spy and last else None
                    sampled = bool(engine == "kvfit" and args.stack_samples and last)
                    pids = {proc.pid, *children(proc.pid)} if sampled else set()
                    stacks_before = sampled_stacks(args.stack_samples, pids) if sampled else None
                    summary = asyncio.run(run_load(port, requests, rate, args.max_concurrency, seed=run))
                    if spy is not None:
                        print_spy(*spy)
                    if sampled:
                        stacks = sampled_since(args.stack_samples, pids, stacks_before)
                        print_stacks(stacks, "stack samples")
                        if not stacks:
                            print(f"stack samples: none from the server's processes in {args.stack_samples}")
                    # where each request's time went inside the engine (queue, prefill, decode), both servers
                    summary.update(phase_means_ms(phases_before, phase_sums(port)))
                    # CPU per output token of the HTTP process and of the engine core: the front-end's share
                    # says how many tokens a second one front-end process can carry
                    tokens = summary["out_tok_s"] * summary["duration_s"]
                    for name, before, after in zip(("frontend", "core"), cpu_before, process_cpu(proc.pid)):
                        summary[f"{name}_cpu_us_per_token"] = (after - before) / max(tokens, 1) * 1e6
                    runs.append(summary)
                    print(f"{engine} {args.model} {args.dataset} rate={rate} run {run}: "
                          + json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in summary.items()}),
                          flush=True)
                results[(engine, rate)] = runs
        finally:
            stop_server(proc)
    table = {}
    for (engine, rate), runs in results.items():
        row = {}
        for key in ("out_tok_s", "req_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p50_ms", "itl_p99_ms",
                    "health_p99_ms", "frontend_cpu_us_per_token", "core_cpu_us_per_token", "cache_releases",
                    *(f"{phase}_mean_ms" for phase in PHASES)):
            values = [r[key] for r in runs if r.get(key) is not None]
            if values:
                row[key] = median_spread(values)
        row["errors"] = sum(sum(r["errors"].values()) for r in runs)
        table[f"{engine} rate={rate}"] = row
        print(f"SUMMARY {args.model} {args.dataset} n={args.num_requests} {engine} rate={rate}: "
              + ", ".join(f"{k} {v[0]:.1f} (spread {v[1]:.1%})" if isinstance(v, tuple) else f"{k} {v}"
                          for k, v in row.items()), flush=True)
    for rate in rates:
        ours = results.get(("kvfit", rate))
        for peer, label in (("vllm", "kvfit/vllm"), ("offline", "kvfit serve / kvfit LLM.generate")):
            theirs = results.get((peer, rate))
            if ours and theirs:
                ratio = (statistics.median(r["out_tok_s"] for r in ours)
                         / statistics.median(r["out_tok_s"] for r in theirs))
                print(f"RATIO {args.model} {args.dataset} n={args.num_requests} rate={rate}: {label} output tok/s "
                      f"{ratio:.3f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "table": table,
                       "runs": {f"{e} rate={r}": v for (e, r), v in results.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
