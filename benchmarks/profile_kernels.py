"""Where the device time of a step goes, kernel by kernel (torch.profiler), and what the host adds.

python benchmarks/profile_kernels.py --model qwen3-0.6b --num-requests 256
python benchmarks/profile_kernels.py --model llama-3.1-8b --num-requests 1
python benchmarks/profile_kernels.py --model llama-3.1-8b --quantization fp8
python benchmarks/profile_kernels.py --model qwen3-30b-a3b --fp8-checkpoint block

Runs the throughput workload (or one request) with one device step per scheduling round, profiles
one prefill (mixed) step, a few consecutive steady-state decode steps (graph replay) and eager decode,
and times the host phases of a decode step. Prints the top kernels by device time and a per-phase table.

A StepDelta runs exactly once (executing it again would re-add its new requests), so every profiled
step is a real step of the workload, scheduled, executed and applied as LLMEngine.step does. Where one
step's inputs are run several times (eager, host phases), the delta's changes are applied to the
persistent batch by hand, its inputs built and run, and the step then finishes through the executor
with those changes taken out; the repeats rewrite the same KV slots with the same values.
"""

from __future__ import annotations

import argparse
import re
import time
from collections import defaultdict
from dataclasses import replace

import torch
from common import gpu_only

from kvfit.runner.batch import build_inputs


def kernel_table(prof, steps: int, top: int = 14) -> str:
    rows = defaultdict(lambda: [0.0, 0])
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            rows[evt.name][0] += evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
            rows[evt.name][1] += 1
    total = sum(t for t, _ in rows.values())
    lines = [f"  device total {total / steps / 1e3:8.3f} ms/step"]
    for name, (t, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {t / steps / 1e3:8.3f} ms/step {100 * t / max(total, 1):5.1f}%  x{n // steps:<4d} {short_name(name)}")
    return "\n".join(lines)


def short_name(name: str) -> str:
    """A kernel's name cut to 90 characters; a torch elementwise kernel's also names its functor (the op: MulFunctor,
    DivFunctor, a lambda's enclosing kernel), which the cut leaves out."""
    if len(name) <= 90 or "at::native" not in name:
        return name[:90]
    ops = re.findall(r"(\w*(?:Functor|_kernel_cuda|_kernel_impl)\w*)", name[90:])
    return name[:90] + (f" [{', '.join(dict.fromkeys(ops))}]" if ops else "")


# steps by hand, as LLMEngine.step runs them ---------------------------------------------------------
def is_mixed(delta) -> bool:
    # some request computes several tokens (a prefill chunk): not a one-token-each decode step
    return delta.num_tokens != len(delta.request_ids)


def finish_step(engine, delta, tokens) -> None:
    """Apply a delta's sampled tokens as LLMEngine.step(stream=False) does: finishes decided, outputs dropped."""
    outputs = {}
    for step in range(delta.max_num_steps):
        engine._apply(delta, tokens, step, False, outputs)


def run_step(engine, delta) -> None:
    finish_step(engine, delta, engine.workers.execute(delta))


def without_changes(delta):
    """The delta once runner.batch.apply(delta) has run: executing it runs the step and applies nothing again."""
    return replace(delta, new_requests=(), finished_ids=(), preempted_ids=(),
                   new_block_ids=((),) * len(delta.request_ids))


def next_decode(engine):
    """Schedule the next step, which must be decode-only (every prefill is done by then)."""
    delta = engine.scheduler.schedule(engine.num_scheduler_steps)
    if delta.empty or is_mixed(delta):
        raise RuntimeError(f"expected a decode step, got {delta.num_tokens} tokens for {len(delta.request_ids)} "
                           "requests (the workload ended, or a request was preempted); lower --decode-warm")
    return delta


def describe(engine, delta) -> str:
    seq_lens = [engine.scheduler.requests[rid].num_computed_tokens + n
                for rid, n in zip(delta.request_ids, delta.num_scheduled_tokens)]
    return f"batch {len(seq_lens)}, mean context {sum(seq_lens) / len(seq_lens):.0f}"


def decode_logits(runner, inputs) -> torch.Tensor:
    """One decode step's model forward and LM head on built inputs: graph replay when captured, else eager."""
    meta = inputs.meta
    if runner.graphs is not None:
        return runner.graphs.replay(inputs.input_ids, inputs.positions, meta.slot_mapping, meta.seq_lens,
                                    meta.block_tables)                                      # [B, vocab]
    hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, meta)       # [B, hidden]
    return runner.model.compute_logits(hidden[inputs.sample_rows])                         # [B, vocab]


def sample(runner, logits, inputs) -> torch.Tensor:
    # the tokens are thrown away; the per-row token counts sample() keeps gain them (nothing reads them here)
    return runner.batch.sampling.sample(logits, inputs.batch_rows, inputs.batch_rows_host, inputs.num_generated)


# the sections ---------------------------------------------------------------------------------------
def warm_up(engine, profile, prefill_index: int, decode_warm: int) -> None:
    """Run the prefills and decode_warm decode steps; profile mixed step number prefill_index."""
    num_mixed = num_decode = 0
    while num_decode < decode_warm:
        delta = engine.scheduler.schedule(engine.num_scheduler_steps)
        if delta.empty:
            raise RuntimeError("the workload ended during warm-up; lower --decode-warm")
        if is_mixed(delta) and num_mixed == prefill_index:
            torch.cuda.synchronize()
            with profile() as prof:
                tokens = engine.workers.execute(delta)
                torch.cuda.synchronize()
            print(f"== prefill step: {delta.num_tokens} tokens, {len(delta.request_ids)} seqs")
            print(kernel_table(prof, 1))
        else:
            tokens = engine.workers.execute(delta)
        finish_step(engine, delta, tokens)
        num_mixed += is_mixed(delta)
        num_decode += not is_mixed(delta)


def profile_decode(engine, profile, steps: int) -> None:
    """Consecutive real decode steps: graph replay, LM head and sampling (batch changes included)."""
    runner = engine.workers.runner
    first = None
    torch.cuda.synchronize()
    with profile() as prof:
        for _ in range(steps):
            delta = next_decode(engine)
            first = first or describe(engine, delta)
            run_step(engine, delta)
        torch.cuda.synchronize()
    print(f"== decode: {first} (first profiled step)")
    print("-- graph replay + lm head + sample" if runner.graphs is not None else "-- eager (no graphs) + sample")
    print(kernel_table(prof, steps, top=18))


def profile_eager(engine, profile, reps: int) -> None:
    """One decode step's inputs built and run eagerly reps times (model, LM head, sampling); then the step
    finishes normally."""
    runner = engine.workers.runner
    delta = next_decode(engine)
    runner.batch.apply(delta)
    bs = runner.spec.block_size
    torch.cuda.synchronize()
    with profile() as prof:
        for _ in range(reps):
            inputs = build_inputs(runner.batch, delta, bs)
            hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta)  # [B, hidden]
            sample(runner, runner.model.compute_logits(hidden[inputs.sample_rows]), inputs)
        torch.cuda.synchronize()
    print("-- eager")
    print(kernel_table(prof, steps=reps, top=24))
    finish_step(engine, delta, engine.workers.execute(without_changes(delta)))


def routing_stats(engine) -> None:
    """How evenly the router spreads one decode step's tokens over the experts, layer by layer (MoE models):
    dummy weights route as they route, and a grouped GEMM's speed depends on it. One eager forward with
    kvfit.models.moe.select_experts wrapped (it syncs the host: run after the timed sections)."""
    from kvfit.models import moe
    runner = engine.workers.runner
    loads = []
    original = moe.select_experts

    def recording(logits, top_k, renormalize, **kwargs):
        weights, ids = original(logits, top_k, renormalize, **kwargs)
        counts = torch.bincount(ids.reshape(-1), minlength=logits.shape[-1]).float()
        loads.append((int((counts > 0).sum()), float(counts.max() / counts.mean()), ids.shape[0]))
        return weights, ids
    delta = next_decode(engine)
    runner.batch.apply(delta)
    moe.select_experts = recording
    try:
        inputs = build_inputs(runner.batch, delta, runner.spec.block_size)
        runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta)
    finally:
        moe.select_experts = original
    finish_step(engine, delta, engine.workers.execute(without_changes(delta)))
    if not loads:
        print("== routing: not a MoE model")
        return
    print(f"== routing of one decode step ({loads[0][2]} tokens), per layer: experts used / max load over mean")
    print("  " + " ".join(f"{n}/{r:.1f}" for n, r, _ in loads))


def host_phases(engine, reps: int) -> dict[str, float]:
    """Seconds per decode step of each phase, synchronised: the parts on one step's inputs, then whole steps."""
    timings = defaultdict(float)

    def timed(name, fn, *a):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(*a)
        torch.cuda.synchronize()
        timings[name] += (time.perf_counter() - t0) / reps
        return out

    runner, graphs = engine.workers.runner, engine.workers.runner.graphs
    delta = next_decode(engine)
    runner.batch.apply(delta)
    forward = "replay+lm_head" if graphs is not None else "eager forward+lm_head"
    for _ in range(reps):
        inputs = timed("build_inputs", build_inputs, runner.batch, delta, runner.spec.block_size)
        logits = timed(forward, decode_logits, runner, inputs)
        timed("sample", sample, runner, logits, inputs)
    if graphs is not None:
        graph = graphs.graphs[graphs.bucket_for(len(delta.request_ids))]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        timings["graph replay only (events)"] = start.elapsed_time(end) / 1e3 / reps
    finish_step(engine, delta, engine.workers.execute(without_changes(delta)))
    for _ in range(reps):           # whole real steps, phase by phase
        delta = timed("schedule", engine.scheduler.schedule, engine.num_scheduler_steps)
        tokens = timed("execute (all)", engine.workers.execute, delta)
        timed("apply outputs", finish_step, engine, delta, tokens)
    # whole engine steps, unsynchronised, on the live requests
    t0 = time.perf_counter()
    n = 0
    while engine.has_unfinished() and n < reps:
        engine.step()
        n += 1
    torch.cuda.synchronize()
    timings["engine.step (live)"] = (time.perf_counter() - t0) / max(n, 1)
    return timings


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--decode-warm", type=int, default=60, help="decode steps before profiling")
    ap.add_argument("--quantization", default=None, help="fp8: the linears in FP8 (per channel, per-token "
                                                          "activations), as `kvfit serve -q fp8`")
    ap.add_argument("--fp8-checkpoint", choices=("channel", "block"), default=None,
                    help="the model's FP8 checkpoint shape (dummy FP8 weights), as bench_vs_vllm.py's KVFIT_BENCH_FP8")
    ap.add_argument("--kv-cache-dtype", default="auto", help="fp8: an fp8 KV cache (as `kvfit serve --kv-cache-dtype`)")
    ap.add_argument("--calculate-kv-scales", action="store_true", help="with an fp8 cache: k/v scales from the "
                                                                       "first batches")
    args = ap.parse_args()
    if args.fp8_checkpoint and args.quantization:
        ap.error("--fp8-checkpoint and --quantization are two ways to FP8 weights: give one")
    if not gpu_only("profile_kernels"):
        return 0
    from functools import partial

    from torch.profiler import ProfilerActivity, profile

    from common import request_set
    from kvfit import LLM, SamplingParams
    from kvfit.model_facts import load_model_facts
    prompts, outs = request_set(args.num_requests, vocab=load_model_facts(args.model).vocab_size)
    if args.num_requests == 1:
        prompts, outs = [prompts[0][:128]], [400]
    # one device step per round: multi-step rounds would fold several decode steps into one profile
    model = args.model
    if args.fp8_checkpoint:
        from bench_vs_vllm import model_folder
        model = model_folder(args.model, "kvfit", args.fp8_checkpoint)
    llm = LLM(model, load_format="dummy", dtype="bfloat16", device="cuda", max_model_len=2048,
              enable_prefix_caching=False, num_scheduler_steps=1, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype, calculate_kv_scales=args.calculate_kv_scales)
    engine = llm.engine
    for p, n in zip(prompts, outs):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    device_profile = partial(profile, activities=[ProfilerActivity.CUDA])
    with torch.inference_mode():        # the steps by hand run the model outside ModelRunner.execute
        # the second prefill step, past any first-step work; a single request has only one
        warm_up(engine, device_profile, prefill_index=1 if len(prompts) > 1 else 0, decode_warm=args.decode_warm)
        profile_decode(engine, device_profile, steps=5)
        profile_eager(engine, device_profile, reps=5)
        routing_stats(engine)
        timings = host_phases(engine, reps=20)
    for name, t in timings.items():
        print(f"  {name:28s} {t * 1e3:8.3f} ms")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
