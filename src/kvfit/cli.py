"""The `kvfit` command line. Flags map one to one onto config fields and use vLLM's names.

Exit status: 0 done; 1 `kvfit plan`: the model does not fit (the plan says why), or stdout was closed
early (`kvfit plan ... | head`); 2 a user mistake, as one line `error: ...` on stderr, never a traceback;
130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import select
import sys

from kvfit.version import __version__
from kvfit.errors import ConfigError, KvfitError


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default: the flag's own, or else the default of the config
    field it sets (a flag left out keeps the config's default). Help that already names its default
    (or says what None means) is left as written."""

    def _get_help_string(self, action):
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS or "default" in text:
            return text
        default = action.default
        if default is None:
            from kvfit.config import setting_default
            default = setting_default(action.dest)
        if default is None:
            return text
        shown = str(default).replace("%", "%%")    # argparse %-formats help text
        return f"{text} (default: {shown})" if text else f"(default: {shown})"


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):  # one line, no usage block
        sys.stderr.write(f"error: {message} (see `{self.prog} --help`)\n")
        raise SystemExit(2)


COMMANDS = ("plan", "generate", "demo", "profile", "serve")


def build_parser() -> argparse.ArgumentParser:
    import importlib
    parser = _Parser(prog="kvfit", description="LLM inference with a KV cache sized from measured memory")
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")
    sub.required = True
    parser.set_defaults(subparsers=sub.choices)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"kvfit.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"kvfit.commands.{name}":
                raise
            continue
        module.register(sub)
    return parser


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (so a BrokenPipeError came from stdout, not from
    a pipe between tensor-parallel ranks, which is a real failure)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):   # no poll on this system, or stdout is no file
        return False


def _silence_stdout() -> None:
    """After the reader of stdout went away: point stdout at devnull so the flush at exit cannot
    raise BrokenPipeError again (the recipe of Python's `signal` documentation)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def out_of_memory(exc: BaseException) -> str:
    """The allocation failure's own words (one line, shortened) when exc is one, else ""."""
    text = str(exc)
    if isinstance(exc, MemoryError) or "can't allocate memory" in text or "out of memory" in text.lower():
        line = next((part for part in text.splitlines() if "allocate" in part or "memory" in part), text)
        return " ".join(line.split())[:200] or type(exc).__name__
    return ""


def vllm_spellings(argv: list[str]) -> list[str]:
    """Flags as vLLM's FlexibleArgumentParser reads them: --max_model_len is --max-model-len (underscores in a flag's
    name, not in its value); --config FILE (vLLM's YAML of flags) is refused by name, not taken for a longer flag."""
    out = []
    for arg in argv:
        if arg.startswith("--") and "_" in arg.partition("=")[0]:
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        if arg == "--config" or arg.startswith("--config="):
            raise ConfigError("--config (a YAML file of flags) is not read by kvfit; pass the flags on the command line")
        out.append(arg)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace | None:
    """The parsed command line; None (after printing the commands) when no command is given. A flag
    the command does not know is an error that points to that command's --help."""
    argv = vllm_spellings(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv:
        parser.print_help()
        return None
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        args.subparsers[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    if hasattr(args, "model_option"):
        from kvfit.commands.flags import model_argument
        model_argument(args)
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)     # inside the try: `kvfit plan --help | head` too
        if args is None:
            return 2
        status = args.run(args) or 0
        sys.stdout.flush()      # inside the try: a closed pipe shows here, not as a traceback at exit
        return status
    except BrokenPipeError:     # `kvfit plan ... | head`: the reader has what it wanted
        if not _stdout_closed():
            raise
        _silence_stdout()
        return 1
    except KvfitError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    except (MemoryError, RuntimeError) as exc:     # torch.OutOfMemoryError is a RuntimeError
        words = out_of_memory(exc)
        if not words:
            raise
        sys.stderr.write(f"error: out of memory ({words}); the settings ask for more than this machine "
                         "has: lower --max-num-seqs (each row's sampling state is vocabulary-sized), "
                         "--max-model-len or --kv-cache-memory\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130


def run_main() -> None:
    """`python -m kvfit` and `python -m kvfit.cli`: exit with main's status."""
    raise SystemExit(main())


if __name__ == "__main__":
    run_main()
