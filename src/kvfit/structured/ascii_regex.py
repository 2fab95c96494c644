"""`\\d`, `\\w` (and `\\D`, `\\W`) in a regex constraint as ASCII classes, as vLLM's default backend reads them.

llguidance's regex engine reads them as Unicode classes (`\\d` matched '᮸', a Sundanese digit); Python's re
with re.ASCII, JavaScript and vLLM's default structured-output backend match 0-9 and [0-9A-Za-z_]. A pure
text rewrite before the regex is compiled: escapes (`\\\\d` is a backslash and a d) are kept; inside a
bracket class `\\d` and `\\w` become their ranges; `\\D` and `\\W` inside a class are left as they are.
"""

from __future__ import annotations

_OUTSIDE = {"d": "[0-9]", "D": "[^0-9]", "w": "[0-9A-Za-z_]", "W": "[^0-9A-Za-z_]"}
_INSIDE = {"d": "0-9", "w": "0-9A-Za-z_"}


def ascii_classes(regex: str) -> str:
    """regex with \\d, \\w, \\D, \\W made ASCII (see the module docstring)."""
    out, i, in_class = [], 0, False
    while i < len(regex):
        char = regex[i]
        if char == "\\" and i + 1 < len(regex):
            escaped = regex[i + 1]
            table = _INSIDE if in_class else _OUTSIDE
            out.append(table.get(escaped, char + escaped))
            i += 2
            continue
        if char == "[" and not in_class:
            in_class = True
            out.append(char)
            # a ']' first in a class (after an optional '^') is a literal, not its end
            for lead in ("^", "]"):
                if regex.startswith(lead, i + 1):
                    out.append(lead)
                    i += 1
        elif char == "]" and in_class:
            in_class = False
            out.append(char)
        else:
            out.append(char)
        i += 1
    return "".join(out)
