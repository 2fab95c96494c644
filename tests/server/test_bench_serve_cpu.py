"""benchmarks/bench_serve.py end to end on the CPU: a real `kvfit serve` on a tiny model, the random and the chat
dataset, with vLLM bench serve's flag names (--num-prompts, --request-rate, --dataset-name, --random-input-len,
--random-output-len, --random-range-ratio, --result-filename)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks",
                     "bench_serve.py")


@pytest.mark.parametrize("dataset,rate", [("random", "inf"), ("chat", "50")])
def test_bench_serve_runs_kvfit_with_vllm_flag_names(tiny_llama, tmp_path, dataset, rate):
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, BENCH, "--model", tiny_llama, "--engines", "kvfit", "--dataset-name", dataset,
                           "--num-prompts", "6", "--request-rate", rate, "--runs", "1", "--random-input-len", "10",
                           "--random-output-len", "4", "--random-range-ratio", "0.5", "--max-model-len", "128",
                           "--max-num-seqs", "4", "--kvfit-args", "--device cpu", "--result-filename", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["args"]["input_len"] == "5,15" and result["args"]["output_len"] == "2,6"
    (key, runs), = result["runs"].items()
    assert key == f"kvfit rate={float(rate)}"
    assert runs[0]["completed"] == 6 and runs[0]["errors"] == {} and runs[0]["out_tok_s"] > 0


def test_a_range_ratio_of_one_or_more_is_refused(tiny_llama):
    proc = subprocess.run([sys.executable, BENCH, "--model", tiny_llama, "--random-input-len", "8",
                           "--random-range-ratio", "1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--random-range-ratio must be in [0, 1)" in proc.stderr


def test_the_allocator_cache_releases_are_read_from_kvfits_metrics(tiny_llama):
    import importlib.util

    from prometheus_client import CollectorRegistry, generate_latest

    from kvfit.config import EngineConfig
    from kvfit.engine.llm_engine import LLMEngine
    from kvfit.server.metrics import _EngineCollector
    spec = importlib.util.spec_from_file_location("bench_serve", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    engine = LLMEngine(EngineConfig.from_kwargs(tiny_llama, device="cpu", dtype="float32", max_model_len=64,
                                                num_gpu_blocks_override=64, block_size=16, max_num_seqs=8))

    def scrape():
        registry = CollectorRegistry()
        registry.register(_EngineCollector(engine.stats, "m"))
        return bench.metric_sums(generate_latest(registry).decode())
    assert "cache_releases" not in scrape()                     # the CPU counts none: no series, no figure
    engine.workers.platform.num_cache_releases = 2
    before = scrape()
    engine.workers.platform.num_cache_releases = 7
    assert before["cache_releases"] == 2
    assert bench.phase_means_ms(before, scrape())["cache_releases"] == 5
