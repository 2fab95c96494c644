"""Tool-call parsers: a model's generated text -> OpenAI tool calls (vLLM's --tool-call-parser NAME).

Each parser reads one family's format, as vLLM's parser of the same name does:
- hermes (Qwen 2.5/3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated;
  text before the first `<tool_call>` is the message content.
- llama3_json (Llama 3.1/3.2): the output is `<|python_tag|>` (optional) then JSON objects
  `{"name": ..., "parameters"|"arguments": {...}}` separated by `; `; no content.
- mistral: text, then `[TOOL_CALLS]` and a JSON list `[{"name": ..., "arguments": {...}}]`, or (the
  v11+ tokenizers) `[TOOL_CALLS]name[ARGS]{...}`, repeated; ids are 9 letters and digits.

Output that does not parse as the format is plain content (tools_called False), never an error:
the model was free to answer in text. `complete_calls` parses the calls that are complete so far
(streaming sends each as soon as it closes); `extract` reads a finished output.
Plain functions and data: no engine, no HTTP.
"""

from __future__ import annotations

import json
import random
import re
import string
import uuid
from dataclasses import dataclass

from kvfit.server.protocol import is_text

_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (OpenAI's shape)."""

    id: str
    name: str
    arguments: str

    def as_json(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Extracted:
    """What a parser read from an output: calls (tools_called when there is at least one) and the
    text content left (None when there is none)."""

    tools_called: bool
    tool_calls: tuple[ToolCall, ...]
    content: str | None


def random_tool_call_id() -> str:
    """vLLM 0.26's default tool call id: chatcmpl-tool-<16 hex digits> (its random_uuid: 64 random bits)."""
    return f"chatcmpl-tool-{uuid.uuid4().int & ((1 << 64) - 1):016x}"


def mistral_tool_call_id() -> str:
    """Mistral's tokenizers accept 9 letters and digits only (vLLM's MistralToolCall)."""
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


def arguments_text(value, dump_strings: bool = False) -> str:
    """Arguments as the JSON text OpenAI sends (a dict is dumped; a string is taken as given unless dump_strings).
    A lone surrogate decoded from a \\ud800 escape cannot be sent as UTF-8: such arguments keep their escapes
    (ASCII JSON)."""
    if isinstance(value, str) and not dump_strings:
        return value if is_text(value) else json.dumps(value)[1:-1]
    text = json.dumps(value, ensure_ascii=False)
    return text if is_text(text) else json.dumps(value)


def _call(obj, new_id, arguments_keys=("arguments",), any_arguments: bool = False) -> ToolCall | None:
    """A ToolCall from a decoded {"name": ..., "arguments": ...} object, or None when it is not one (a name
    holding a lone surrogate, which no response can carry, included). any_arguments: the arguments key must be
    there and any JSON value is dumped (llama3_json's full reply, as vLLM's); else an object or a string, {} when
    absent."""
    name = obj.get("name") if isinstance(obj, dict) else None
    if not isinstance(name, str) or not name or not is_text(name):
        return None
    key = next((k for k in arguments_keys if k in obj), None)
    if any_arguments:
        return None if key is None else ToolCall(new_id(), name, arguments_text(obj[key], dump_strings=True))
    arguments = obj[key] if key is not None else {}
    if not isinstance(arguments, (dict, str)):
        return None
    return ToolCall(new_id(), name, arguments_text(arguments))


def _decode_objects(text: str, separator: str) -> tuple[list, bool]:
    """JSON values from the start of text, each after the last and `separator` (whitespace around it
    allowed): (the values decoded, whether all of text was used)."""
    values, at = [], 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return values, True
        try:
            value, at = _DECODER.raw_decode(text, at)
        except ValueError:            # not JSON, or an integer past 4,300 digits
            return values, False
        values.append(value)
        rest = text[at:].lstrip()
        if rest.startswith(separator.strip()) and separator.strip():
            at = len(text) - len(rest) + len(separator.strip())
        elif rest:
            return values, False


class ToolParser:
    """One format. start_markers: texts that open the tool calls (a stream holds back text that may be
    the start of one); keeps_special_tokens: the markers are special tokens in some models, so the
    output is detokenized with them (vLLM's adjust_request: skip_special_tokens false)."""

    name = ""
    start_markers: tuple[str, ...] = ()
    keeps_special_tokens = True

    def new_id(self) -> str:
        return random_tool_call_id()

    def tool_start(self, text: str) -> int | None:
        """Where the tool calls begin in text, or None (no call has begun)."""
        found = [text.find(m) for m in self.start_markers if m in text]
        return min(found) if found else None

    def complete_calls(self, text: str) -> list[ToolCall]:
        """The calls complete in text so far (text: from tool_start on), in order."""
        raise NotImplementedError

    def partial_call(self, text: str, index: int) -> tuple[str, str] | None:
        """The index-th call of text (from tool_start on) while it arrives: (its name, the raw text from
        the start of its arguments object to the end of text), once the name and the arguments' opening
        have come; None before, or for a format this parser does not stream piece by piece."""
        return None

    def held_back(self, text: str) -> int:
        """How many characters at the end of text a stream holds back: they may begin a marker."""
        return max((k for m in self.start_markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)

    def extract(self, text: str) -> Extracted:
        start = self.tool_start(text)
        if start is None:
            return Extracted(False, (), text)
        calls = self._all_calls(text[start:])
        if not calls:
            return Extracted(False, (), text)
        return Extracted(True, tuple(calls), text[:start] or None)

    def _all_calls(self, text: str) -> list[ToolCall] | None:
        raise NotImplementedError


# the opening of a call object with its name first: {"name": "...", "arguments": (or "parameters")
_NAME_THEN_ARGUMENTS = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')


def _name_and_arguments(body: str) -> tuple[str, str] | None:
    """(name, raw arguments text to the end of body) of a call object body that has begun its arguments object."""
    match = _NAME_THEN_ARGUMENTS.match(body)
    if match is None:
        return None
    name = json.loads(match.group(1))
    return (name, body[match.end():]) if is_text(name) else None


def _after_values(text: str, count: int, separator: str) -> str | None:
    """text after its first `count` JSON values (each followed by `separator`), or None when fewer are there."""
    at = 0
    for _ in range(count):
        try:
            _, at = _DECODER.raw_decode(text, len(text) - len(text[at:].lstrip()))
        except ValueError:            # not JSON, or an integer past 4,300 digits
            return None
        rest = text[at:].lstrip()
        if not rest.startswith(separator):
            return None
        at = len(text) - len(rest) + len(separator)
    return text[at:]


def _without_partial_end(body: str, end: str = "</tool_call>") -> str:
    """An open block's body less a tail that may be the start of its end tag (held back until it is not)."""
    held = max((k for k in range(1, len(end)) if body.endswith(end[:k])), default=0)
    return body[:len(body) - held]


class HermesParser(ToolParser):
    name = "hermes"
    start_markers = ("<tool_call>",)
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def complete_calls(self, text: str) -> list[ToolCall]:
        calls = []
        for body in re.findall(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL):
            call = self._parse(body)
            if call is None:
                break
            calls.append(call)
        return calls

    def partial_call(self, text: str, index: int) -> tuple[str, str] | None:
        # the blocks as complete_calls finds them: a <tool_call> inside a call's JSON string opens none, and a
        # closed block's body ends before its </tool_call>
        bodies = [closed or _without_partial_end(open_) for closed, open_ in self._BLOCK.findall(text)]
        return _name_and_arguments(bodies[index]) if index < len(bodies) else None

    def _parse(self, body: str) -> ToolCall | None:
        try:
            return _call(json.loads(body.strip()), self.new_id)
        except ValueError:            # not JSON, or an integer past 4,300 digits
            return None

    def _all_calls(self, text: str) -> list[ToolCall] | None:
        calls = [self._parse(a or b) for a, b in self._BLOCK.findall(text)]
        return None if not calls or None in calls else calls


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    start_markers = ("<|python_tag|>",)
    keeps_special_tokens = False       # vLLM's parser leaves skip_special_tokens as the request says

    def tool_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith("<|python_tag|>") or stripped.startswith("{"):
            return len(text) - len(stripped)
        return None

    def held_back(self, text: str) -> int:
        # undecided until the first non-space character says JSON or text
        stripped = text.lstrip()
        return len(text) if not stripped or "<|python_tag|>".startswith(stripped) else 0

    def _body(self, text: str) -> str:
        text = text.lstrip()
        return text[len("<|python_tag|>"):] if text.startswith("<|python_tag|>") else text

    def partial_call(self, text: str, index: int) -> tuple[str, str] | None:
        body = _after_values(self._body(text), index, ";")
        return None if body is None else _name_and_arguments(body)

    def complete_calls(self, text: str) -> list[ToolCall]:
        values, _ = _decode_objects(self._body(text), ";")
        calls = [_call(v, self.new_id, ("arguments", "parameters")) for v in values]
        return calls[:calls.index(None)] if None in calls else calls

    def extract(self, text: str) -> Extracted:
        """The full reply, as vLLM 0.26's llama3_json reads it (llama_tool_parser.extract_tool_calls): every
        top-level JSON object in the text is a call ({"name", "arguments" or "parameters"}), the text around
        them dropped (content null); one that does not decode or is no call makes the whole text content. The
        stream sends calls only where the text opens with one (as vLLM's)."""
        calls, end = [], -1
        for match in re.finditer(r"\{", text):
            if match.start() < end:
                continue
            try:
                value, end = _DECODER.raw_decode(text, match.start())
            except ValueError:           # not JSON, or an integer past 4,300 digits
                return Extracted(False, (), text)
            call = _call(value, self.new_id, ("arguments", "parameters"), any_arguments=True)
            if call is None:
                return Extracted(False, (), text)
            calls.append(call)
        return Extracted(True, tuple(calls), None) if calls else Extracted(False, (), text)


class MistralParser(ToolParser):
    name = "mistral"
    start_markers = ("[TOOL_CALLS]",)

    def new_id(self) -> str:
        return mistral_tool_call_id()

    def partial_call(self, text: str, index: int) -> tuple[str, str] | None:
        pieces = self._pieces(text)
        if pieces and pieces[0].lstrip().startswith("["):        # one JSON list of calls
            body = _after_values(pieces[0].lstrip()[1:], index, ",")
            return None if body is None else _name_and_arguments(body)
        if index >= len(pieces) or "[ARGS]" not in pieces[index]:   # name[ARGS]{...}, one piece a call
            return None
        name, _, arguments = pieces[index].partition("[ARGS]")
        return (name.strip(), arguments.lstrip()) if name.strip() and arguments.lstrip().startswith("{") else None

    def _pieces(self, text: str) -> list[str]:
        return [p for p in text.split("[TOOL_CALLS]") if p.strip()]

    def _parse_piece(self, piece: str, finished: bool) -> list[ToolCall] | None:
        """One piece after a [TOOL_CALLS]: a JSON list (or object) of calls, or name[ARGS]{...}."""
        if "[ARGS]" in piece and not piece.lstrip().startswith(("[", "{")):
            name, _, args = piece.partition("[ARGS]")
            try:
                value, end = _DECODER.raw_decode(args.strip())
            except ValueError:            # not JSON, or an integer past 4,300 digits
                return None
            if args.strip()[end:].strip() or not name.strip():
                return None
            return [ToolCall(self.new_id(), name.strip(), arguments_text(value))]
        body = piece.strip()
        if body.startswith("[") and finished:     # the list, text after it ignored (vLLM's raw_decode)
            try:
                values = _DECODER.raw_decode(body)[0]
            except ValueError:            # not JSON, or an integer past 4,300 digits
                return None
        elif body.startswith("["):
            values, _ = _decode_objects(body[1:].rstrip().removesuffix("]"), ",")
        else:
            values, whole = _decode_objects(body, ",")
            if finished and not whole:
                return None
        calls = [_call(v, self.new_id) for v in values]
        return None if None in calls else calls

    def complete_calls(self, text: str) -> list[ToolCall]:
        calls = []
        pieces = self._pieces(text)
        for i, piece in enumerate(pieces):
            # the last piece may still grow: its calls count once their JSON closes
            parsed = self._parse_piece(piece, finished=i < len(pieces) - 1)
            if parsed is None:
                break
            calls.extend(parsed)
        return calls

    def _all_calls(self, text: str) -> list[ToolCall] | None:
        calls = []
        for piece in self._pieces(text):
            parsed = self._parse_piece(piece, finished=True)
            if not parsed:
                return None
            calls.extend(parsed)
        return calls or None


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def get_parser(name: str) -> ToolParser:
    """The parser named by --tool-call-parser; a KeyError for another name (the flag's check names them)."""
    return PARSERS[name]()
