"""Shared by the GPU benchmarks: copy bandwidth, HF reference models, seeded request sets."""

from __future__ import annotations

import random
import time

import torch


def gpu_only(name: str) -> bool:
    """True with a CUDA device; otherwise say this benchmark runs on a GPU only (and exit 0)."""
    if torch.cuda.is_available():
        return True
    print(f"{name}: no CUDA device; this benchmark runs on a GPU only")
    return False


def copy_bandwidth(num_bytes: int = 4 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (num_bytes // 2) * 2 / times[len(times) // 2]


def request_set(num: int, in_range=(128, 1024), out_range=(128, 512), vocab: int = 32000, seed: int = 0):
    """Seeded prompts (token ids) and output lengths."""
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(num):
        prompts.append([rng.randrange(10, vocab - 10) for _ in range(rng.randint(*in_range))])
        outs.append(rng.randint(*out_range))
    return prompts, outs


def hf_model(catalog_name: str, dtype=torch.bfloat16):
    """A random-weight transformers model of a catalog model's shape, on CUDA."""
    import transformers
    from kvfit.catalog import model_config
    cfg = model_config(catalog_name)
    cfg.pop("architectures", None)
    model_type = cfg.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **cfg)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    return model.eval()


@torch.inference_mode()
def hf_generate_throughput(model, prompts, outs, batch_size: int, static: bool = False) -> tuple[float, int]:
    """Output tokens per second of HF generate over the requests, batched in prompt order.

    Each batch is left-padded and runs to its longest output (min_new_tokens forces it, since
    random weights may emit eos); only each request's own output length is counted as useful.
    """
    total_tokens, total_time = 0, 0.0
    pad = 0
    for i in range(0, len(prompts), batch_size):
        batch, lens = prompts[i:i + batch_size], outs[i:i + batch_size]
        width = max(map(len, batch))
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, p in enumerate(batch):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        kwargs = dict(max_new_tokens=max(lens), min_new_tokens=max(lens), do_sample=False, pad_token_id=pad)
        if static:
            kwargs["cache_implementation"] = "static"
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), **kwargs)
        torch.cuda.synchronize()
        total_time += time.perf_counter() - start
        total_tokens += sum(lens)
    return total_tokens / total_time, total_tokens


def graph_time(fn, reps: int = 20, flush_bytes: int = 256 << 20, trials: int = 5) -> float:
    """Seconds per call of fn replayed in a CUDA graph (as the engine runs decode: no Python launch cost),
    with L2 flushed before each call (as between layers, each with its own cache); the median of `trials`
    replays of `reps` calls, less the flushes' own time measured the same way."""
    flush = torch.empty(flush_bytes, dtype=torch.int8, device="cuda")

    def replay_time(body) -> float:
        body()                                          # compile / warm up outside the capture
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            for _ in range(reps):
                body()
        torch.cuda.current_stream().wait_stream(stream)
        times = []
        for _ in range(trials):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / reps)
        return sorted(times)[len(times) // 2]

    both = replay_time(lambda: (flush.zero_(), fn()))
    return max(both - replay_time(flush.zero_), 0.0)
