"""MixedGraphs without a GPU: a step with prefill chunks run through a bucket's static buffers (padded to the
bucket, the tile-mapped attention grid) gives the eager step's hidden states and writes the same cache slots.

The model runs on the Triton backend in Triton's CPU interpreter; graph capture itself needs a GPU
(tests/gpu/test_engine_gpu.py runs the engine with these graphs against transformers)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
if not torch.cuda.is_available():
    from triton_interpreter import apply_interpreter_fixes
    apply_interpreter_fixes()

from paged_batch import PagedCache, random_tokens  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

from kvfit.model_facts import load_model_facts  # noqa: E402
from kvfit.models.loader import load_model  # noqa: E402
from kvfit.planning import MIXED_BUCKETS, MIXED_TP_MAX_TOKENS, mixed_buckets  # noqa: E402
from kvfit.runner.cuda_graphs import MixedGraphs  # noqa: E402

if torch.cuda.is_available():
    pytest.skip("the interpreter's CPU run of the graph buffers (a GPU runs the real graphs in tests/gpu)",
                allow_module_level=True)


def _triton_backend():
    from kvfit.attention.triton_backend import TritonBackend
    return TritonBackend()


def _clone(caches):
    return [(k.clone(), v.clone()) for k, v in caches]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
@torch.inference_mode()
def test_a_mixed_step_through_the_buckets_buffers_equals_the_eager_step(tmp_path, arch):
    folder = make_tiny_model(tmp_path, arch)
    facts = load_model_facts(folder)
    model = load_model(folder, facts, torch.float32, "cpu", _triton_backend())
    cache = PagedCache(facts, block_size=4, num_blocks=64, seed=1)
    vocab = facts.vocab_size
    # a first step fills prefixes; the second mixes a decode, a chunk over a prefix and a fresh prompt
    ids, pos, meta = cache.step([("a", 0, random_tokens(vocab, 9, 1)), ("b", 0, random_tokens(vocab, 5, 2))])
    model(ids, pos, cache.caches, meta)
    ids, pos, meta = cache.step([("a", 9, random_tokens(vocab, 1, 3)), ("b", 5, random_tokens(vocab, 3, 4)),
                                 ("c", 0, random_tokens(vocab, 6, 5))])
    eager_caches, graph_caches = _clone(cache.caches), _clone(cache.caches)
    expected = model(ids, pos, eager_caches, meta)                                    # [10, hidden]

    graphs = MixedGraphs(model, graph_caches, [16, 32], max_num_seqs=4, max_blocks_per_seq=8, max_model_len=32,
                         block_size=4, device=torch.device("cpu"))
    size = graphs.bucket_for(ids.shape[0], meta.num_seqs)
    assert size == 16
    for stale in (0, 1):           # buffers left by an earlier, larger step do not leak into this one
        if stale:
            graphs.fill_one_sequence(32)
            graphs.block_tables.fill_(3)
        graphs.fill(size, ids, pos, meta)
        got = graphs.run(size)
        assert got.shape[0] == size
        torch.testing.assert_close(got[:ids.shape[0]], expected, atol=1e-5, rtol=1e-5)
    # the same slots written (NaN where nothing was: the padding rows wrote nothing), the values within the
    # rounding of GEMMs over 16 rows instead of 10
    for (ek, ev), (gk, gv) in zip(eager_caches, graph_caches):
        torch.testing.assert_close(gk, ek, equal_nan=True, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gv, ev, equal_nan=True, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_a_small_bucket_attends_only_the_rows_a_step_of_its_size_can_use(tmp_path):
    # 8 sequence rows, but a 4-token bucket holds at most 4 sequences and the padding one: its grid spans 5 rows;
    # a step of 3 tokens in 2 sequences, then one of 4 tokens in 4 sequences (no padding), equal the eager steps
    folder = make_tiny_model(tmp_path, "llama")
    facts = load_model_facts(folder)
    model = load_model(folder, facts, torch.float32, "cpu", _triton_backend())
    cache = PagedCache(facts, block_size=4, num_blocks=64, seed=2)
    vocab = facts.vocab_size
    graphs = MixedGraphs(model, cache.caches, [4, 16], max_num_seqs=8, max_blocks_per_seq=8, max_model_len=32,
                         block_size=4, device=torch.device("cpu"))
    meta = graphs._meta(4)
    assert meta.query_start_loc.shape == (6,) and meta.seq_lens.shape == (5,) and meta.block_tables.shape[0] == 5
    assert graphs._meta(16).seq_lens.shape == (9,)
    steps = [[("a", 0, random_tokens(vocab, 2, 1)), ("b", 0, random_tokens(vocab, 1, 2))],
             [("a", 2, random_tokens(vocab, 1, 3)), ("b", 1, random_tokens(vocab, 1, 4)),
              ("c", 0, random_tokens(vocab, 1, 5)), ("d", 0, random_tokens(vocab, 1, 6))]]
    for chunks in steps:
        ids, pos, meta = cache.step(chunks)
        expected = model(ids, pos, _clone(cache.caches), meta)
        size = graphs.bucket_for(ids.shape[0], meta.num_seqs)
        assert size == 4
        graphs.fill(size, ids, pos, meta)
        got = graphs.run(size)[:ids.shape[0]]
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_bucket_choice_and_candidates():
    graphs = MixedGraphs(None, [], [32, 64, 128], max_num_seqs=8, max_blocks_per_seq=2, max_model_len=32,
                         block_size=16, device=torch.device("cpu"))
    assert graphs.bucket_for(10, 3) == 32 and graphs.bucket_for(33, 3) == 64 and graphs.bucket_for(128, 8) == 128
    assert graphs.bucket_for(129, 3) is None            # more tokens than the largest bucket: eager
    assert graphs.bucket_for(20, 9) is None             # more sequences than the buffers hold: eager
    # the padding sequence's table row reaches the largest bucket's last token (128 tokens of 16: 8 blocks)
    assert graphs.block_tables.shape == (9, 8)
    assert graphs.query_start_loc.shape == (10,)
    assert mixed_buckets(8192, False) == list(MIXED_BUCKETS)
    assert mixed_buckets(8192, True)[-1] == MIXED_TP_MAX_TOKENS
    assert mixed_buckets(300, False) == [b for b in MIXED_BUCKETS if b < 300] + [300]
    assert mixed_buckets(1, False) == []


class _StubGraphs:
    """choose_mixed_buckets' view of MixedGraphs: buckets, filling, an eager run, a capture, release."""

    def __init__(self, buckets):
        self.buckets, self.graphs, self.hidden, self.pool = buckets, {}, {}, None
        self.ran, self.released = [], False

    def fill_one_sequence(self, size):
        self.filled = size

    def run(self, size):
        self.ran.append(("eager", size))

    def capture(self, size, stream):
        self.pool = object()
        self.graphs[size] = type("G", (), {"replay": lambda _self, size=size: self.ran.append(("replay", size))})()
        self.hidden[size] = None

    def release(self):
        self.released = True


def test_buckets_are_kept_while_the_replay_beats_the_eager_launch():
    from kvfit.runner.cuda_graphs import MIXED_GRAPH_GAIN, choose_mixed_buckets
    host = {32: 10.0, 64: 10.0, 128: 10.0, 256: 10.0}                  # eager launch, s
    replay = {32: 1.0, 64: 5.0, 128: 10.0 * MIXED_GRAPH_GAIN + 0.5, 256: 1.0}
    graphs = _StubGraphs([32, 64, 128, 256])

    def timed(fn):
        fn()
        kind, size = graphs.ran[-1]
        return (host[size], host[size] + 1.0) if kind == "eager" else (0.1, replay[size])

    kept = choose_mixed_buckets(graphs, None, timed=timed)
    # 128's replay is past the share of its eager launch: it and every larger bucket (256 never timed) are dropped
    assert kept == [(32, 10.0, 1.0), (64, 10.0, 5.0)]
    assert ("eager", 256) not in graphs.ran
    assert graphs.released and not graphs.graphs and graphs.pool is None


def test_timed_reports_the_launch_and_the_end():
    from kvfit.runner.cuda_graphs import _timed
    import time as _time
    syncs = []

    def sync():
        syncs.append(1)
        if len(syncs) % 2 == 0:         # the device's end: after fn returned
            _time.sleep(0.02)

    host, wall = _timed(lambda: _time.sleep(0.01), repeats=2, sync=sync)
    assert 0.009 < host < wall and wall >= 0.029
    assert len(syncs) == 4
