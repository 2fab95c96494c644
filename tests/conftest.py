"""Shared fixtures: tiny random-weight model folders (built once per test session; see tiny_models.py)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # tests/tiny_models.py importable everywhere

# Without CUDA, Triton's kernels run in its interpreter (as the kernel test modules ask). Set here, before any test
# module is collected: a module that imports the kernels first would otherwise pin Triton's compiled path for the
# whole session, and every interpreted kernel test collected after it would fail (pytest tests/models tests/kernels).
if "TRITON_INTERPRET" not in os.environ:
    import torch
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

from tiny_models import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """Llama, GQA (4 query heads, 2 KV heads), bos added, chat template."""
    return make_tiny_model(tmp_path_factory.mktemp("models"), arch="llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    """Qwen2: bias on q/k/v, no bos."""
    return make_tiny_model(tmp_path_factory.mktemp("models"), arch="qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    """Qwen3: per-head q/k RMSNorm, head_dim 32 != hidden 64 / 4 heads."""
    return make_tiny_model(tmp_path_factory.mktemp("models"), arch="qwen3")


@pytest.fixture(scope="module")
def tiny_server(tiny_llama):
    """A server of the tiny llama named "tiny", with the server tests' settings (tests/server/server_testing.py):
    its base URL."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "server"))
    from server_testing import make_engine, running_server
    engine = make_engine(tiny_llama)
    try:
        with running_server(engine, "tiny") as (url, _):
            yield url
    finally:
        engine.shutdown()
