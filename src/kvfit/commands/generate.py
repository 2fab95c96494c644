"""`kvfit generate MODEL --prompt TEXT ...`: offline generation from the command line."""

from __future__ import annotations

import json
import sys

from kvfit.errors import ConfigError


def register(sub) -> None:
    from kvfit.cli import add_engine_flags
    from kvfit.commands.common import add_sampling_flags
    p = sub.add_parser("generate", help="generate text for prompts")
    p.add_argument("model", metavar="MODEL", help="model folder (or a catalog name with --load-format dummy)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompt-file", default=None, help="a file with one prompt per line")
    p.add_argument("--json", action="store_true", help='one JSON object per line: {"prompt", "text", "token_ids"}')
    add_sampling_flags(p)
    add_engine_flags(p)
    p.set_defaults(run=run)


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompt_file:
        try:
            with open(args.prompt_file, encoding="utf-8") as fh:
                prompts += [line.rstrip("\n") for line in fh if line.strip()]
        except OSError as exc:
            raise ConfigError(f"cannot read --prompt-file {args.prompt_file}: {exc.strerror}") from None
    if not prompts:
        raise ConfigError("no prompts: give --prompt TEXT (repeatable) or --prompt-file F")
    return prompts


def run(args) -> int:
    from kvfit.cli import engine_kwargs
    from kvfit.commands.common import sampling_params, setup_logging
    setup_logging()
    prompts = read_prompts(args)
    params = sampling_params(args, args.seed)
    from kvfit.engine.llm import LLM
    llm = LLM(args.model, **engine_kwargs(args))
    try:
        outputs = llm.generate(prompts, params, use_tqdm=not args.json and sys.stderr.isatty())
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outputs):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": out.text, "token_ids": out.token_ids}), flush=True)
        else:
            print(f"prompt: {prompt!r}\noutput: {out.text!r}  ({len(out.token_ids)} tokens, {out.finish_reason})")
    return 0
