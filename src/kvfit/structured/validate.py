"""Validate a grammar definition where llguidance cannot take the server down.

llguidance builds a grammar recursively in Rust: a chain of about 2,600 rules or $refs overflows its
stack and the process dies (SIGSEGV), and a large grammar takes seconds. Specs are bounded when built
(structured_params' limits), and on top of that a definition over SMALL_DEFINITION_CHARS (the size below
which no definition nests deep enough to crash) is validated in a child process with a timeout first:
a crash or a timeout there is one request's RequestError, never the server's death.

Children are forked from multiprocessing's fork server, which imports only this module (and
llguidance), so one costs about 10 ms after the first (which starts the fork server, about 0.2 s).
This module imports no torch: the fork server stays small. The parent's main script is not imported in the
child (_main_not_reimported): an offline script without a __main__ guard would run again there.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import re
import sys
import threading

import llguidance

from kvfit.errors import RequestError
from kvfit.structured_params import PARAM      # no torch: the fork server stays small

SMALL_DEFINITION_CHARS = 4096       # at most ~250 chained rules: far from the ~2,600 that crash llguidance
VALIDATE_TIMEOUT_S = 10.0           # a definition that takes longer to validate is refused
PARSER_LIMITS = dict(verbose_errors=False)   # llguidance's LLParserLimits for every kvfit grammar

# lines of a library message that only point at the fault ("   1 | start: foo", "      ^")
_CONTEXT_LINE = re.compile(r"^\s*(\d+\s*\|.*|\^+)?\s*$")


def one_line(message: str) -> str:
    """A library's error as one line: source echo, carets and a Rust panic's backtrace dropped; a panic
    (an internal limit of llguidance) said as such."""
    message = message.split("<backtrace>", 1)[0].replace("<non-verbose/>", "")
    kept = [line.strip() for line in message.splitlines() if not _CONTEXT_LINE.match(line)]
    text = " ".join(kept)[:500] or "rejected by the grammar library"
    if text.startswith("panic:"):
        text = (f"the grammar library cannot build this grammar (its internal limit:{text[len('panic:'):]}); "
                "give a smaller one")
    return text


def parser_limits() -> "llguidance.LLParserLimits":
    return llguidance.LLParserLimits(**PARSER_LIMITS)


def validation_error(definition: str) -> str | None:
    """llguidance's one-line error for definition (None: it is valid), in this process."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(definition, limits=parser_limits())
    return one_line(messages[0]) if is_error else None


def _child(definition: str, conn) -> None:
    conn.send(validation_error(definition))
    conn.close()


def check_definition(kind: str, definition: str, timeout_s: float = VALIDATE_TIMEOUT_S) -> None:
    """RequestError (param structured_outputs) when llguidance refuses, crashes on or takes more than
    timeout_s over definition; a small definition is validated here, a large one in a child process."""
    if len(definition) <= SMALL_DEFINITION_CHARS:
        error = validation_error(definition)
    else:
        error = _validate_in_child(kind, definition, timeout_s)
    if error is not None:
        raise RequestError(f"structured_outputs.{kind}: {error}", PARAM)


_MAIN_LOCK = threading.Lock()


@contextlib.contextmanager
def _main_not_reimported():
    """multiprocessing prepares a forkserver child by importing the parent's main script, which runs a script's
    top level again when it has no `if __name__ == "__main__"` guard (an offline script would load its model
    in the child, which then dies). The child needs only this module, so the main module's file and spec are
    hidden while it starts (under a lock: two checks at once would restore each other's hidden state; another
    thread starting a process of its own in that moment sees the main module hidden too)."""
    with _MAIN_LOCK:
        main = sys.modules.get("__main__")
        saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__} if main else {}
        try:
            if "__file__" in saved:
                del main.__file__
            if "__spec__" in saved:
                main.__spec__ = None
            yield
        finally:
            for key, value in saved.items():
                setattr(main, key, value)


def _validate_in_child(kind: str, definition: str, timeout_s: float) -> str | None:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(definition, send), name="kvfit-grammar-check", daemon=True)
    with _main_not_reimported():
        process.start()
    send.close()
    try:
        if receive.poll(timeout_s):
            try:
                return receive.recv()
            except EOFError:                 # the child died before it answered
                pass
        else:
            process.kill()
            process.join()
            return (f"the grammar library did not finish checking this {kind} within {timeout_s:g} s; "
                    "give a smaller one")
        process.join()
        return (f"the grammar library crashed on this {kind} (exit code {process.exitcode}); give a smaller or "
                "shallower one")
    finally:
        receive.close()
        if process.is_alive():
            process.join(1.0)
