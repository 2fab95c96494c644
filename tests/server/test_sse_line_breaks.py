"""Issue 27 (low): U+2028, U+2029 and U+0085 in generated text are escaped in SSE JSON, so a client that splits
the stream with str.splitlines sees each event whole."""

from __future__ import annotations

import json

from kvfit.server.protocol import sse


def test_unicode_line_separators_are_escaped_and_the_event_means_the_same():
    text = "a\u2028b\u2029c\x85d\x0be\x1cf é 中"
    event = sse({"choices": [{"text": text}]}).decode("utf-8")
    lines = [line for line in event.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0][len("data: "):]) == {"choices": [{"text": text}]}
    assert "é 中" in event                  # other non-ASCII text stays as it is
