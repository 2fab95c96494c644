"""`kvfit generate MODEL --prompt TEXT ...`: offline generation from the command line."""

from __future__ import annotations

import json
import os
import sys

from kvfit.errors import ConfigError


def register(sub) -> None:
    from kvfit.commands.flags import add_engine_flags, add_model_argument
    from kvfit.commands.common import add_sampling_flags
    p = sub.add_parser("generate", help="generate text for prompts")
    add_model_argument(p, "a catalog name with --load-format dummy")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable; default: none)")
    p.add_argument("--prompt-file", default=None,
                   help="a file with one prompt per line, - for stdin (default: none)")
    p.add_argument("--prompt-token-ids", action="append", default=[], metavar="IDS",
                   help="a prompt as comma-separated token ids, e.g. 1,2,3 (repeatable; for models without a "
                        "tokenizer; default: none)")
    p.add_argument("--json", action="store_true",
                   help='one JSON object per line: {"prompt", "text", "token_ids", "finish_reason", "stop_reason", '
                        '"num_prompt_tokens", "num_output_tokens"}')
    add_sampling_flags(p)
    add_engine_flags(p)
    p.set_defaults(run=run)


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ConfigError(f"--prompt-token-ids {text!r} is not a comma-separated list of integers, e.g. 1,2,3") from None
    if not ids:
        raise ConfigError("--prompt-token-ids is empty; give at least one token id")
    return ids


def read_prompts(args, folder: str) -> list:
    """Text prompts (--prompt, --prompt-file), then token-id prompts (--prompt-token-ids); text needs
    the tokenizer.json of the model folder."""
    prompts = list(args.prompt)
    if args.prompt_file == "-":
        prompts += [line.rstrip("\n") for line in sys.stdin if line.strip()]
    elif args.prompt_file:
        try:
            with open(args.prompt_file, encoding="utf-8") as fh:
                prompts += [line.rstrip("\n") for line in fh if line.strip()]
        except OSError as exc:
            raise ConfigError(f"cannot read --prompt-file {args.prompt_file}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"--prompt-file {args.prompt_file} is not UTF-8 text ({exc.reason} at byte "
                              f"{exc.start})") from None
    if prompts and not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        raise ConfigError(f"{args.model} has no tokenizer.json, so text prompts cannot be encoded; "
                          "give --prompt-token-ids 1,2,3 instead")
    prompts += [_token_ids(t) for t in args.prompt_token_ids]
    if not prompts:
        raise ConfigError("no prompts: give --prompt TEXT (repeatable), --prompt-file F or --prompt-token-ids IDS")
    return prompts


def run(args) -> int:
    from kvfit.commands.flags import engine_kwargs
    from kvfit.commands.common import engine_startup, sampling_params, setup_logging
    from kvfit.config import EngineConfig
    setup_logging()
    config = EngineConfig.from_kwargs(args.model, **engine_kwargs(args))   # a missing model is the first error
    prompts = read_prompts(args, config.model.model)
    from kvfit.sampling_params import SamplingParams
    sampling_params(args, args.seed, SamplingParams())       # a bad flag fails before the model loads
    from kvfit.engine.llm import LLM
    with engine_startup(config):
        llm = LLM.from_config(config)        # the model resolved once (at --revision), by the config
    try:
        params = sampling_params(args, args.seed, llm.get_default_sampling_params())
        outputs = llm.generate(prompts, params, use_tqdm=not args.json and sys.stderr.isatty())
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outputs):
        sample = out.outputs[0]
        if args.json:
            print(json.dumps({"prompt": prompt, "text": sample.text, "token_ids": list(sample.token_ids),
                              "finish_reason": sample.finish_reason, "stop_reason": sample.stop_reason,
                              "num_prompt_tokens": len(out.prompt_token_ids),
                              "num_output_tokens": len(sample.token_ids)}, ensure_ascii=False), flush=True)
        else:
            print(f"prompt: {prompt!r}\noutput: {sample.text!r}  ({len(sample.token_ids)} tokens, {sample.finish_reason})")
    return 0
