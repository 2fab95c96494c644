"""What torch's cuDNN attention op does on this device: the questions to answer before routing any attention through it.
kvfit has no cuDNN route now: one for long prefill chunks (built on 2026-12-04) was slower end to end and was removed
after its profile of 2026-12-05 (docs/benchmarks-history.md says why; the code is in git history, 25cc998 and 62e1140).
bench_prefill_attention.py times torch SDPA's cuDNN backend beside kvfit's prefill kernel as a reference.

Questions (each answered by a printed line; nothing is assumed):
1. Does the dense op (`aten._scaled_dot_product_cudnn_attention`) take the engine's layout: q/k/v as strided
   views of one fused qkv projection ([T, Hq + 2 Hkv, D] -> [1, H, T, D] permuted), grouped-query K/V
   (Hkv < Hq) without expanding, and return a log-sum-exp we can merge with (natural log, [1, Hq, T, 1])?
2. What a first call at a new sequence length costs (cuDNN builds a graph per shape), and a cached one.
3. The ragged op (`aten._cudnn_attention_forward` with cumulative sequence offsets): does it run, is it
   right, does it cache its graph across calls (a later torch release fixed a rebuild on every call)?

usage: python3 benchmarks/probe_cudnn_attention.py [--q-heads 16 --kv-heads 8 --head-dim 128]
"""

from __future__ import annotations

import argparse
import time

import torch


def reference(q, k, v, scale):
    """fp32 causal attention of one sequence: q [T, Hq, D], k/v [T, Hkv, D] -> out [T, Hq, D], lse [Hq, T]."""
    group = q.shape[1] // k.shape[1]
    qf, kf, vf = (t.float().transpose(0, 1) for t in (q, k, v))
    kf, vf = kf.repeat_interleave(group, 0), vf.repeat_interleave(group, 0)
    scores = qf @ kf.transpose(1, 2) * scale
    length = q.shape[0]
    mask = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return (torch.softmax(scores, -1) @ vf).transpose(0, 1), lse


def fused_views(length, hq, hkv, d, gen):
    qkv = torch.randn(length, hq + 2 * hkv, d, dtype=torch.bfloat16, device="cuda", generator=gen)
    return qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return result, time.perf_counter() - t0


def dense(q, k, v, scale):
    """q [T, Hq, D] views -> (out [T, Hq, D], lse as returned)."""
    to4 = lambda t: t.transpose(0, 1).unsqueeze(0)   # noqa: E731  [1, H, T, D], a view
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(to4(q), to4(k), to4(v), None, True, 0.0, True, False,
                                                              scale=scale)
    return res[0][0].transpose(0, 1), res[1]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--q-heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    hq, hkv, d = args.q_heads, args.kv_heads, args.head_dim
    scale = d ** -0.5
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}, "
          f"heads {hq}/{hkv} x {d}", flush=True)

    # 1. dense op on the engine's layout
    for label, gqa in (("grouped K/V views", True), ("K/V expanded, contiguous", False)):
        q, k, v = fused_views(777, hq, hkv, d, gen)
        if not gqa:
            q, k, v = (t.repeat_interleave(hq // hkv, 1).contiguous() if t is not q else t.contiguous()
                       for t in (q, k, v))
        try:
            out, lse = dense(q, k, v, scale)
            ref, ref_lse = reference(q, k, v, scale)
            print(f"dense, {label}: out {tuple(out.shape)} max|diff| {(out.float() - ref).abs().max().item():.2e}; "
                  f"lse {tuple(lse.shape)} {lse.dtype} max|diff| vs natural-log "
                  f"{(lse.reshape(hq, -1).float() - ref_lse).abs().max().item():.2e}", flush=True)
        except Exception as exc:     # noqa: BLE001  a probe: report and go on
            print(f"dense, {label}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)

    # 2. graph build cost per new length, and the cached call
    for length in (1024, 1100, 2048, 4096, 7808, 8000, 8192):
        q, k, v = fused_views(length, hq, hkv, d, gen)
        try:
            _, first = timed(lambda: dense(q, k, v, scale))
            _, second = timed(lambda: dense(q, k, v, scale))
            q2, k2, v2 = fused_views(length, hq, hkv, d, gen)
            _, other = timed(lambda: dense(q2, k2, v2, scale))
            print(f"dense T={length}: first call {first * 1e3:.1f} ms, again {second * 1e3:.2f} ms, "
                  f"new tensors same shape {other * 1e3:.2f} ms", flush=True)
        except Exception as exc:     # noqa: BLE001
            print(f"dense T={length}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)

    # 3. ragged op over several sequences of one flat batch
    op = getattr(torch.ops.aten, "_cudnn_attention_forward", None)
    if op is None:
        print("ragged: no aten._cudnn_attention_forward in this build", flush=True)
        return 0
    for lens in ((1500, 700, 3000), (1500, 700, 3000), (2000, 900), (4000, 1, 33, 1200), (8000,)):
        total = sum(lens)
        q, k, v = fused_views(total, hq, hkv, d, gen)
        cum = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device="cuda")
        for dtype in (torch.int32,):
            try:
                res, first = timed(lambda: op(q, k, v, None, cum.to(dtype), cum.to(dtype), max(lens), max(lens),
                                              True, 0.0, True, False, scale=scale))
                _, second = timed(lambda: op(q, k, v, None, cum.to(dtype), cum.to(dtype), max(lens), max(lens),
                                             True, 0.0, True, False, scale=scale))
                out, lse = res[0], res[1]
                errs, start = [], 0
                for length in lens:
                    ref, ref_lse = reference(q[start:start + length], k[start:start + length],
                                             v[start:start + length], scale)
                    errs.append((out[start:start + length].float() - ref).abs().max().item())
                    start += length
                print(f"ragged {lens}: out {tuple(out.shape)} lse {tuple(lse.shape)} {lse.dtype}; max|diff| per seq "
                      f"{['%.1e' % e for e in errs]}; first {first * 1e3:.1f} ms, again {second * 1e3:.2f} ms",
                      flush=True)
            except Exception as exc:     # noqa: BLE001
                print(f"ragged {lens}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
