"""The import graph of src/kvfit, read with ast: one-way layering and no import circles; and device questions
(`.is_cuda`, `.device.type`) only in platforms/ and kernels/.

Layers, lowest first: a module may import its own layer's modules and lower layers only.
server -> engine -> runner -> (platforms) -> models -> attention -> contract types -> config, kernels -> kv, text.
kernels/ (every Triton kernel and its launcher) sits below everything that calls them (attention, models, runner)
and beside config: it reads only the platforms' gate, kv's spec constants, quant_scheme's FP8 constants, errors,
units and itself.
text/ (tokenizer, chat template, detokenizer, generation config) is what the server and the engine share;
it reads only model_facts and errors, so it sits low, beside kv, and imports no torch.
Every import counts, at module level or inside a function (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "kvfit"

# component -> rank (a top-level module or a subpackage of kvfit)
LAYERS = {
    "errors": 0, "version": 0,
    "units": 1, "catalog": 1,
    "model_facts": 2, "hub": 2,          # hub: model ids -> local Hugging Face cache folders
    "quant_scheme": 1,                   # FP8 schemes from quantization_config (no torch)
    "kv": 3,
    "text": 3,                           # tokenizer, chat template, detokenizer, generation config
    "config": 4,
    "kernels": 4,                        # Triton kernels and launchers (test_kernels_import_only_their_inputs)
    "structured_params": 4,              # StructuredOutputsParams, held by sampling_params
    "sampling_params": 5,
    "planning": 6,                       # reads sampling_params (the prompt-logprobs slice bound)
    "step": 6,
    "attention": 7,
    "models": 8,
    "platforms": 9, "structured": 9,     # structured: grammar compile/match for structured outputs
    "runner": 10,
    "engine": 11,
    "server": 12,
    "commands": 13,
    "cli": 14, "__init__": 14, "__main__": 15,
}
# modules ranked apart from their component. platforms/ owns the --device names, which config.py checks, and the
# one gate of the Triton kernels, which their launchers ask: these modules (and the
# package module) import nothing of platforms/ but the registry (and kvfit.errors), so they sit below config.
MODULE_LAYERS = {
    "kvfit.platforms": 3, "kvfit.platforms.registry": 3, "kvfit.platforms.gate": 3,
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _component(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _imports(path: Path, module: str) -> set[str]:
    """Every kvfit module `path` imports (absolute or relative, anywhere in the file)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "kvfit")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "kvfit":
                continue
            for alias in node.names:       # `from kvfit.kv import pool` names a module
                candidate = f"{base}.{alias.name}"
                found.add(candidate if _exists(candidate) else base)
    return found


def _exists(module: str) -> bool:
    path = SRC.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _graph() -> dict[str, set[str]]:
    graph = {}
    for path in sorted(SRC.rglob("*.py")):
        module = _module_name(path)
        graph[module] = {m for m in _imports(path, module) if m != module}
    return graph


GRAPH = _graph()


def test_every_component_has_a_layer():
    assert {_component(m) for m in GRAPH} <= set(LAYERS), "a new top-level module or package needs a layer here"


def _rank(module: str) -> int:
    return MODULE_LAYERS.get(module, LAYERS[_component(module)])


def test_imports_run_one_way():
    wrong = []
    for module, deps in GRAPH.items():
        rank = _rank(module)
        for dep in deps:
            same = _component(dep) == _component(module)    # within a component only a higher rank is wrong
            if _rank(dep) > rank or (_rank(dep) == rank and not same):
                wrong.append(f"{module} -> {dep}")
    assert wrong == []


def _imports_named(path: Path, name: str) -> bool:
    """Whether the file imports the module `name` or one under it (any package, not only kvfit)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    return any(n == name or n.startswith(name + ".") for n in names)


@pytest.mark.parametrize("forbidden", ["torch", "kvfit.config"])
def test_kv_imports_neither_torch_nor_config(forbidden):
    for path in (SRC / "kv").rglob("*.py"):
        assert not _imports_named(path, forbidden), f"{path.name} imports {forbidden}"


def test_text_imports_no_torch():
    # the HTTP front-end tokenizes, renders templates and detokenizes; none of that needs torch
    for path in (SRC / "text").rglob("*.py"):
        assert not _imports_named(path, "torch"), f"{path.name} imports torch"


# what kernels/ may import besides itself: the one device gate and the constants the kernels share with their callers
KERNEL_IMPORTS = ("kvfit.platforms.gate", "kvfit.kv", "kvfit.quant_scheme", "kvfit.errors", "kvfit.units")


def test_kernels_import_only_their_inputs():
    wrong = [f"{module} -> {dep}" for module, deps in GRAPH.items() if _component(module) == "kernels"
             for dep in deps if _component(dep) != "kernels"
             and not any(dep == allowed or dep.startswith(allowed + ".") for allowed in KERNEL_IMPORTS)]
    assert wrong == []


# device questions outside platforms/ and kernels/ (expression -> why it may stay); anything else asks platforms/
DEVICE_CHECKS_ALLOWED = {
    ("kvfit.structured.matcher", "bitmask.device.type"): "an internal assert: llguidance fills host memory only",
}


def _device_checks(path: Path) -> list[str]:
    """`x.is_cuda` and `x.device.type` / `device.type` attribute reads in the file, as source text."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        of_device = ((isinstance(owner, ast.Attribute) and owner.attr == "device")
                     or (isinstance(owner, ast.Name) and owner.id == "device"))
        if node.attr == "is_cuda" or (node.attr == "type" and of_device):
            found.append(ast.unparse(node))
    return found


def test_device_questions_stay_in_platforms_and_kernels():
    wrong, used = [], set()
    for path in sorted(SRC.rglob("*.py")):
        module = _module_name(path)
        if _component(module) in ("platforms", "kernels"):
            continue
        for expr in _device_checks(path):
            if (module, expr) in DEVICE_CHECKS_ALLOWED:
                used.add((module, expr))
            else:
                wrong.append(f"{module}: {expr}")
    assert wrong == [], "ask kvfit.platforms (gate.on_gpu, the platform) instead"
    assert used == set(DEVICE_CHECKS_ALLOWED), "an allowed device check is gone: drop it from the list"


# DESIGN's edges per component, not only ranks: what each component imports besides itself. The chain is
# server -> engine -> runner -> models -> attention -> kernels, with contract types, config and kv below; the
# other edges are named with the reason they exist. A new edge fails here: add it with its reason, or route it
# through the layer DESIGN says owns it (the server reaches the engine only through ServingEngine, so it
# imports no runner, models, attention or kernels).
BASE = {"errors", "units", "version"}
ALLOWED = {
    "catalog": set(), "quant_scheme": set(), "units": set(), "version": set(), "errors": set(),
    "hub": {"catalog"},
    "model_facts": {"catalog", "quant_scheme"},
    "kv": {"model_facts"},
    "text": {"model_facts"},
    "config": {"quant_scheme", "model_facts", "hub", "kv",
               "platforms"},                       # the --device names (platforms.registry, ranked below config)
    "kernels": {"quant_scheme", "kv", "platforms"},   # FP8 constants, PADDING_SLOT_ID, the one gate
    "structured_params": set(), "sampling_params": {"structured_params"},
    "planning": {"model_facts", "kv", "config", "sampling_params"},
    "step": {"sampling_params"},
    "attention": {"kv", "kernels", "platforms"},
    "models": {"quant_scheme", "model_facts", "kv", "kernels", "attention", "platforms"},
    "platforms": {"quant_scheme", "model_facts", "kv", "config", "planning",
                  "models"},                       # the CPU platform's start-up estimate reads the weight files
    "structured": {"structured_params"},
    "runner": {"model_facts", "kv", "config", "kernels", "sampling_params", "step", "planning", "attention",
               "models", "platforms", "structured"},
    "engine": {"hub", "model_facts", "kv", "text", "config", "sampling_params", "planning", "step",
               "structured", "platforms", "runner",
               "attention", "models"},             # start-up: the backend registry, and the loader's weight check
    "server": {"text", "kv", "structured_params", "sampling_params", "structured", "engine"},
    "commands": {"catalog", "hub", "model_facts", "kv", "text", "config", "sampling_params", "planning",
                 "attention", "platforms", "engine", "server"},
    "cli": {"config", "commands"}, "__init__": {"sampling_params", "engine"}, "__main__": {"cli"},
}


def test_components_import_only_what_design_allows():
    found: dict[str, set[str]] = {}
    for module, deps in GRAPH.items():
        for dep in deps:
            if _component(dep) != _component(module):
                found.setdefault(_component(module), set()).add(_component(dep))
    wrong = {c: sorted(deps - ALLOWED.get(c, set()) - BASE) for c, deps in found.items()}
    assert {c: d for c, d in wrong.items() if d} == {}


def _registry_strings() -> list[tuple[str, str]]:
    """Every "kvfit.x.y:Name" string constant in src (the registries name classes lazily this way)."""
    pattern = re.compile(r"kvfit(\.\w+)+:\w+")
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and pattern.fullmatch(node.value):
                found.append((_module_name(path), node.value))
    return found


def test_registry_strings_name_classes_that_exist():
    strings = _registry_strings()
    assert len(strings) >= 6          # model architectures, attention backends, platforms
    missing = []
    for holder, value in strings:
        module, name = value.split(":")
        path = SRC.parent.joinpath(*module.split("."))
        path = path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"
        defined = path.is_file() and any(isinstance(n, ast.ClassDef) and n.name == name
                                         for n in ast.parse(path.read_text(encoding="utf-8")).body)
        if not defined:
            missing.append(f"{holder}: {value}")
    assert missing == []


def test_no_import_circles():
    """Depth-first search over modules; a back edge is a circle (reported with its path)."""
    state: dict[str, int] = {}          # 1: on the current path, 2: done
    path: list[str] = []
    circles = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for dep in sorted(GRAPH.get(module, ())):
            dep = dep if dep in GRAPH else dep.rpartition(".")[0]
            if state.get(dep) == 1:
                circles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep in GRAPH and dep not in state:
                visit(dep)
        path.pop()
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)
    assert circles == []


def test_the_graph_is_read():
    # guards the reader itself: known edges must be found
    assert "kvfit.kv.pool" in GRAPH["kvfit.kv.manager"]
    assert "kvfit.step" in GRAPH["kvfit.engine.scheduler"]
    assert "kvfit.text.tokenizer" in GRAPH["kvfit.text.detokenizer"]
    assert "kvfit.kernels.attention_decode" in GRAPH["kvfit.attention.triton_backend"]
