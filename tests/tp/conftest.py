"""Tensor-parallel tests: 2 ranks over gloo on CPU, started by the engine through kvfit.LLM.

Every test must leave no rank process behind (checked after each test), and runs with few torch
threads (the engine gives each rank its share of them).
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from tiny_models import make_tiny_model


@pytest.fixture(autouse=True)
def _few_threads_and_no_orphans():
    threads = torch.get_num_threads()
    torch.set_num_threads(min(threads, 2))
    yield
    torch.set_num_threads(threads)
    assert multiprocessing.active_children() == [], "a tensor-parallel rank outlived its test"


@pytest.fixture(scope="session")
def tiny_mqa_tied(tmp_path_factory) -> str:
    """Llama with 1 KV head (replicated at tp=2), tied embeddings, a vocabulary 2 does not divide."""
    return make_tiny_model(tmp_path_factory.mktemp("models"), arch="llama", num_kv_heads=1, vocab_size=321,
                           tie_word_embeddings=True, seed=7)
