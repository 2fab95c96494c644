"""The attention backend table: one line per backend, readable without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvfit.attention.registry import BACKENDS, backend_class, backend_max_offset, backend_names, get_backend
from kvfit.errors import ConfigError
from kvfit.kv.plan import OFFSET_64_BIT


@pytest.mark.parametrize("name", list(BACKENDS))
def test_each_line_names_its_class_and_offset(name):
    backend = get_backend(name)
    assert type(backend) is backend_class(name) and backend.name == name
    assert backend.max_element_offset == backend_max_offset(name) == BACKENDS[name].max_element_offset


def test_names_and_offsets():
    assert backend_names() == ("torch", "triton")
    assert all(backend_max_offset(name) == OFFSET_64_BIT for name in backend_names())   # every offset 64-bit


def test_an_unknown_backend_lists_the_known_ones():
    for lookup in (get_backend, backend_max_offset):
        with pytest.raises(ConfigError) as err:
            lookup("flash")
        assert str(err.value) == "unknown attention backend 'flash'; use one of torch, triton"


def test_planning_imports_neither_torch_nor_triton():
    code = ("import sys, kvfit.attention.registry, kvfit.commands.plan; "
            "print([m for m in ('torch', 'triton') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
