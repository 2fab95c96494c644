"""What a mixed step (decodes plus one prefill chunk) costs eagerly, against the same step as one CUDA graph.

python benchmarks/probe_mixed_step.py --model qwen3-0.6b --decodes 56 --chunks 0 64 128 256 512 1024

Builds the engine (dummy weights), then runs the model's forward on a hand-made mixed batch over the real KV
cache: `decodes` sequences of one token each (context `--context`) and one prefill chunk of N new tokens. For each
N it prints, in ms per step (median of --iters, after a warm-up):
- eager: the forward and the logits of the sampled rows, launched and synchronised, as _execute_one runs them;
- host: the time Python takes to launch that work (the device may still run it afterwards);
- graph: the same forward captured once in a CUDA graph and replayed (the device's time with no launch overhead).
eager - graph is what capturing mixed steps could save; N = 0 is a decode-only step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import gpu_only


def find_runner(engine):
    workers = engine.workers
    worker = getattr(workers, "worker", workers)
    return worker.runner


def mixed_inputs(runner, num_decodes: int, context: int, chunk: int, block_size: int):
    from kvfit.attention.base import AttentionMetadata
    device = runner.device
    lens_q = [1] * num_decodes + ([chunk] if chunk else [])
    seq_lens = [context] * num_decodes + ([chunk] if chunk else [])
    blocks_per_seq = -(-max(seq_lens) // block_size)
    tables, slots, positions, next_block = [], [], [], 1
    for q, s in zip(lens_q, seq_lens):
        row = list(range(next_block, next_block + -(-s // block_size)))
        next_block += len(row)
        tables.append(row + [0] * (blocks_per_seq - len(row)))
        for p in range(s - q, s):
            positions.append(p)
            slots.append(row[p // block_size] * block_size + p % block_size)
    starts = [0]
    for q in lens_q:
        starts.append(starts[-1] + q)
    num_tokens = starts[-1]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        max_query_len=max(lens_q), max_seq_len=max(seq_lens), query_start_loc_host=starts, seq_lens_host=seq_lens)
    ids = torch.randint(0, 1000, (num_tokens,), dtype=torch.int64, device=device)
    pos = torch.tensor(positions, dtype=torch.int64, device=device)
    sample_rows = torch.tensor([s - 1 for s in starts[1:]], dtype=torch.int64, device=device)
    return ids, pos, meta, sample_rows, next_block


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--decodes", type=int, default=56)
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 64, 128, 256, 512, 1024])
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    if not gpu_only("probe_mixed_step"):
        return 0
    from kvfit import LLM
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", device="cuda", max_model_len=2048,
              enable_prefix_caching=False)
    runner = find_runner(llm.engine)
    model, kv = runner.model, runner.kv_caches
    block_size = runner.spec.block_size
    mixed = getattr(runner, "mixed_graphs", None)
    print(f"the engine's mixed-step graphs: {mixed.buckets if mixed is not None else 'none'} tokens")
    print(f"{args.model}: {args.decodes} decodes at context {args.context}, one prefill chunk of N tokens; "
          f"ms per step, median of {args.iters}")
    print(f"{'N':>6} {'tokens':>7} {'eager':>8} {'host':>8} {'graph':>8} {'eager/graph':>12}")
    with torch.inference_mode():
        for chunk in args.chunks:
            ids, pos, meta, rows, used = mixed_inputs(runner, args.decodes, args.context, chunk, block_size)
            assert used <= kv[0][0].shape[0], "the KV cache has too few blocks for this probe"

            def step():
                hidden = model(ids, pos, kv, meta)
                return model.compute_logits(hidden[rows])

            for _ in range(3):
                step()
            torch.cuda.synchronize()
            eager, host = [], []
            for _ in range(args.iters):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                step()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                eager.append((t2 - t0) * 1e3)
                host.append((t1 - t0) * 1e3)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                step()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    step()
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            replay = []
            for _ in range(args.iters):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                replay.append(start.elapsed_time(end))
            del graph
            e, h, g = statistics.median(eager), statistics.median(host), statistics.median(replay)
            print(f"{chunk:>6} {len(ids):>7} {e:>8.3f} {h:>8.3f} {g:>8.3f} {e / g:>12.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
