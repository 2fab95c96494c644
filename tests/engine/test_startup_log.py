"""Start-up says what it loads (source, size, shards, dtype) and how long loading and profiling took,
and the capacity line comes once."""

from __future__ import annotations

import logging
import os

from kvfit.config import EngineConfig
from kvfit.engine.startup import loading_line
from kvfit.model_facts import load_model_facts
from tiny_models import make_tiny_model

SMALL = dict(device="cpu", dtype="float32", kv_cache_memory="16MiB", max_model_len=64, max_num_batched_tokens=64,
             max_num_seqs=4)


def test_the_loading_line_names_source_size_shards_and_dtype(tmp_path):
    folder = make_tiny_model(tmp_path, max_shard_size="40KB")
    config = EngineConfig.from_kwargs(folder, **SMALL)
    shards = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
    line = loading_line(config, load_model_facts(folder))
    assert line.startswith(f"loading: {folder}: ") and f"in {len(shards)} shards" in line and "float32" in line
    dummy = EngineConfig.from_kwargs("qwen3-0.6b", load_format="dummy", dtype="bfloat16")
    line = loading_line(dummy, load_model_facts("qwen3-0.6b"))
    assert "random weights (--load-format dummy) for qwen3-0.6b: 0.60B parameters, 1.11 GiB in bfloat16" in line


def test_start_up_logs_loading_timing_and_capacity_once(tiny_llama, caplog):
    from kvfit import LLM
    caplog.set_level(logging.INFO, logger="kvfit")
    llm = LLM(tiny_llama, **SMALL)
    llm.shutdown()
    messages = [r.getMessage() for r in caplog.records if r.name == "kvfit"]
    assert sum(m.startswith("loading: ") for m in messages) == 1
    assert sum(m.startswith("loaded and profiled in ") for m in messages) == 1
    assert sum(m.startswith("KV cache: ") for m in messages) == 1
