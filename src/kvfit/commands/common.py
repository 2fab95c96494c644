"""Helpers shared by the engine subcommands."""

from __future__ import annotations

import logging
import sys


def setup_logging() -> None:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(levelname)s kvfit: %(message)s")


def add_sampling_flags(p) -> None:
    from kvfit.commands.flags import int_flag
    p.add_argument("--max-tokens", type=int_flag, default=16)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int_flag, default=-1)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def sampling_params(args, seed):
    from kvfit.sampling_params import SamplingParams
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=seed,
                          max_tokens=args.max_tokens, stop=tuple(args.stop or ()), ignore_eos=args.ignore_eos)
