"""The `kvfit` command line. Flags map one to one onto config fields and use vLLM's names.

Every user mistake ends as one line `error: ...` on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from kvfit.errors import KvfitError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block
        sys.stderr.write(f"error: {message} (see `{self.prog} --help`)\n")
        raise SystemExit(2)


COMMANDS = ("plan", "generate", "demo", "profile", "serve")


def build_parser() -> argparse.ArgumentParser:
    import importlib
    parser = _Parser(prog="kvfit", description="LLM inference with a KV cache sized from measured memory")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"kvfit.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"kvfit.commands.{name}":
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args) or 0
    except KvfitError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
