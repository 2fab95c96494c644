"""Structured-output specs that crashed llguidance (issue 27, item 1): chains of rules or $refs it builds
recursively, so about 2,600 links overflow its stack. Shared by the unit and adversarial tests."""

from __future__ import annotations

CHAIN = 3000


def lark_chain(n: int) -> str:
    """A Lark grammar of n + 1 rules, each referring to the next."""
    return "start: r0\n" + "".join(f'r{i}: r{i + 1} "a"\n' for i in range(n)) + f'r{n}: "b"\n'


def ref_chain(n: int, all_of: bool = False) -> dict:
    """A JSON schema whose $defs chain n deep through $ref (each link inside an allOf when all_of)."""
    def link(i):
        ref = {"$ref": f"#/$defs/a{i + 1}"}
        return {"allOf": [ref]} if all_of else ref
    return {"$ref": "#/$defs/a0", "$defs": {**{f"a{i}": link(i) for i in range(n)}, f"a{n}": {"type": "string"}}}
