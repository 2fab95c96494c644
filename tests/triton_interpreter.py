"""Test-only shims for Triton 3.6's interpreter (TRITON_INTERPRET=1; the GPU compiler is unaffected)."""

from __future__ import annotations


def apply_interpreter_fixes() -> None:
    """- the interpreter turns loop bounds into ints with int(1-element array), which NumPy >= 2.4 rejects;
    - tl.dot on bfloat16 multiplies the raw uint16 bit patterns; widen bf16 operands to fp32 first
      (exact, and what the tensor cores do: bf16 products accumulated in fp32). Idempotent."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interp
    if getattr(interp, "_kvfit_shims", False):
        return
    patch_tensor = interp._patch_lang_tensor

    def patched_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def widen(h):
        if h.dtype != tl.bfloat16:
            return h
        return interp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    create_dot = interp.InterpreterBuilder.create_dot
    interp._patch_lang_tensor = patched_tensor
    interp.InterpreterBuilder.create_dot = lambda self, a, b, *rest: create_dot(self, widen(a), widen(b), *rest)
    interp._kvfit_shims = True


def run_compile_check(test_file: str, ok_line: str) -> None:
    """Run `test_file --compile-check` (the kernels compiled for sm_90 through Triton's bundled ptxas, no GPU
    needed) in a fresh process without TRITON_INTERPRET; skip when this Triton bundles no ptxas."""
    import os
    import subprocess
    import sys

    import pytest
    triton = pytest.importorskip("triton")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this triton has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, test_file, "--compile-check"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and ok_line in done.stdout, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def ptxas_spills(compiled) -> tuple[int, str]:
    """Assemble a kernel compiled for sm_90 with Triton's bundled ptxas -v -> (bytes of register spill
    stores, ptxas's report)."""
    import os
    import re
    import subprocess
    import tempfile

    import triton
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(compiled.asm["ptx"])
        f.flush()
        report = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr
    return sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", report)), report


def compile_sm90(kernel, signature: dict, constexprs: dict, divisible, options: dict):
    """Compile a kernel for sm_90 ahead of time, as a launch specialises it (the args named in `divisible`
    16-divisible), and assemble it -> (compiled, bytes of register spill stores, ptxas's report)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    div16 = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if n in divisible}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=div16),
                              target=GPUTarget("cuda", 90, 32), options=options)
    return (compiled, *ptxas_spills(compiled))
