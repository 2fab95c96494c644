"""Command-line flags shared by the subcommands; they map one to one onto config fields (vLLM's names)."""

from __future__ import annotations

import argparse


def _positive_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


INT64_MAX = 2**63 - 1


def _seed(text: str) -> int:
    """--seed: the one range check of the engine seed given on the command line."""
    try:
        value = int(text)
    except ValueError:   # not an integer, or past Python's 4,300 digits
        value = None
    from kvfit.config import MAX_SEED
    if value is None or not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**64 - 1], got {text[:40]!r}")
    return value


def int_flag(text: str) -> int:
    """An integer flag: it must fit int64, since torch holds every count and id as int64 (range checks
    beyond that belong to the config field the flag sets)."""
    try:
        value = int(text)
    except ValueError:   # not an integer, or past Python's 4,300 digits
        raise argparse.ArgumentTypeError(f"expected an integer, got {text[:40]!r}") from None
    if not -INT64_MAX - 1 <= value <= INT64_MAX:
        raise argparse.ArgumentTypeError(f"{text[:40]} is out of range; use an integer below 2**63")
    return value


def add_capacity_flags(p: argparse.ArgumentParser) -> None:
    """Flags that shape the KV plan (shared by plan, generate, serve, profile)."""
    p.add_argument("--gpu-memory-utilization", type=_positive_float, default=None,
                   help="fraction of device memory that may be in use while serving (default 0.9)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int_flag, default=None)
    p.add_argument("--block-size", type=int_flag, default=None, help="tokens per KV block (power of two, default 16)")
    p.add_argument("--kv-cache-dtype", default=None, help="auto, bfloat16, float16, float32 or fp8")
    p.add_argument("--max-model-len", type=int_flag, default=None, help="longest request (prompt + output) in tokens")
    p.add_argument("--max-num-batched-tokens", type=int_flag, default=None)
    p.add_argument("--max-num-seqs", type=int_flag, default=None)
    p.add_argument("--num-gpu-blocks-override", type=int_flag, default=None,
                   help="use exactly this many KV blocks (must fit in memory)")
    p.add_argument("--max-num-blocks", type=int_flag, default=None, help="an explicit cap on KV blocks (default none)")
    p.add_argument("--kv-cache-memory", default=None, help="KV cache bytes, e.g. 20GiB (replaces the utilization budget)")
    p.add_argument("--dtype", default=None, help="auto, float32, bfloat16 or float16")
    p.add_argument("--attention-backend", default=None, help="torch or triton (default: the platform's)")


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """Flags of a running engine (generate, serve, profile, demo)."""
    add_capacity_flags(p)
    p.add_argument("--device", default=None, help="auto, cpu or cuda")
    p.add_argument("--load-format", default=None, help="auto, safetensors or dummy (random weights)")
    p.add_argument("--seed", type=_seed, default=None, help="seed of the engine's random numbers (0 to 2**64 - 1)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")
    p.add_argument("--num-scheduler-steps", type=int_flag, default=None,
                   help="decode steps per scheduling round, tokens kept on the device between them "
                        "(default: 8 on CUDA with one rank, else 1)")
    p.add_argument("--plan-json", default=None, help="write the KV plan as JSON to this path")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The config settings given on the command line (None = not given, keep the default)."""
    from kvfit.config import setting_names
    return {name: getattr(args, name) for name in setting_names()
            if name != "model" and getattr(args, name, None) is not None}
