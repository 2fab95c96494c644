"""CUDA graphs for decode steps, one per batch-size bucket, replayed with static input buffers.

Captured after the KV cache is allocated (their memory is measured first by a trial capture during
start-up, see platforms/cuda.py). Padded rows write to PADDING_SLOT_ID (skipped by the kernels)
and attend to one token of block 0, so they touch only valid memory. Buckets where the attention backend
would attend a shared prefix once for all sequences (cascade) get a second graph that reads the prefix
length from a static buffer; its padded rows also attend that prefix (row 0's blocks: valid memory, and
their output is dropped).
"""

from __future__ import annotations

import bisect
import time
from typing import Callable

import torch

from kvfit.attention.base import AttentionMetadata
from kvfit.kv.spec import PADDING_SLOT_ID

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def smallest_bucket(buckets: list[int], size: int) -> int | None:
    """The smallest of the ascending buckets that holds size, or None when none does."""
    index = bisect.bisect_left(buckets, size)
    return buckets[index] if index < len(buckets) else None


def batch_buckets(max_num_seqs: int) -> list[int]:
    sizes = [b for b in BUCKETS if b < max_num_seqs]
    return sizes + [max_num_seqs]


class DecodeGraphs:
    """Static buffers shared by every bucket's graph; replay() runs one decode step."""

    def __init__(self, model, kv_caches, max_num_seqs: int, max_blocks_per_seq: int, max_model_len: int,
                 device: torch.device, cascade_tokens: Callable[[int, int], int] | None = None):
        """cascade_tokens: the attention backend's (AttentionBackend.cascade_tokens); buckets it would use a
        shared prefix at get a second graph that attends one (None: none)."""
        self.model = model
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        n = max_num_seqs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)           # [B]
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)           # [B]
        self.slot_mapping = torch.full((n,), PADDING_SLOT_ID, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)             # [B]
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.prefix_len = torch.zeros(1, dtype=torch.int32, device=device)                 # cascade graphs'
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.cascade_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # graphs end at the final norm: logits [B, vocab] per bucket would pin a buffer per bucket in
        # the pool (sum of buckets x vocab x 4 bytes), so the LM head runs eagerly after replay
        self.hidden: dict[tuple[int, bool], torch.Tensor] = {}
        self.pool = None
        self.buckets = batch_buckets(max_num_seqs)
        # asked with max_model_len: no shared prefix is longer
        self.cascade_buckets = {b for b in self.buckets
                                if cascade_tokens is not None and cascade_tokens(max_model_len, b) > 0}

    def _meta(self, batch: int, cascade: bool) -> AttentionMetadata:
        # max_seq_len is the graph's worst case so the kernels' launch grid fits any step; a cascade graph
        # reads its prefix length from the static buffer at replay (0 is valid: nothing shared)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch], query_start_loc=self.query_start_loc[:batch + 1],
            seq_lens=self.seq_lens[:batch], block_tables=self.block_tables[:batch], max_query_len=1,
            max_seq_len=self.max_model_len, prefix_len=self.prefix_len if cascade else None)

    def _run(self, batch: int, cascade: bool) -> torch.Tensor:
        # -> hidden states [B, hidden]
        return self.model(self.input_ids[:batch], self.positions[:batch], self.kv_caches, self._meta(batch, cascade))

    @torch.inference_mode()
    def capture(self, stream: torch.cuda.Stream) -> None:
        """Capture every bucket on `stream`: the caller keeps one capture stream for the process,
        since cuBLAS keeps a workspace per stream and a new stream per capture would add one."""
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for batch in reversed(self.buckets):        # largest first: later graphs reuse its pool
                for cascade in (True, False) if batch in self.cascade_buckets else (False,):
                    self._run(batch, cascade)           # warm-up (Triton compiles outside capture)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                        self.hidden[batch, cascade] = self._run(batch, cascade)
                    if self.pool is None:
                        self.pool = graph.pool()
                    (self.cascade_graphs if cascade else self.graphs)[batch] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def bucket_for(self, batch: int) -> int | None:
        return smallest_bucket(self.buckets, batch)

    @torch.inference_mode()
    def replay(self, input_ids, positions, slot_mapping, seq_lens, block_tables,
               prefix_len: torch.Tensor | None = None) -> torch.Tensor:
        """Inputs for B <= max_num_seqs decode rows; returns logits [B, vocab]. prefix_len: [1] int32, the
        step's shared prefix (AttentionMetadata.prefix_len), or None."""
        batch = input_ids.shape[0]
        size = self.bucket_for(batch)
        cascade = prefix_len is not None and size in self.cascade_graphs
        if cascade:
            self.prefix_len.copy_(prefix_len)
        self.input_ids[:batch].copy_(input_ids)
        self.positions[:batch].copy_(positions)
        self.slot_mapping[:batch].copy_(slot_mapping)
        self.slot_mapping[batch:size].fill_(PADDING_SLOT_ID)
        self.seq_lens[:batch].copy_(seq_lens)
        self.seq_lens[batch:size].fill_(1)
        width = block_tables.shape[1]
        self.block_tables[:batch, :width].copy_(block_tables)
        self.block_tables[batch:size].zero_()
        (self.cascade_graphs if cascade else self.graphs)[size].replay()
        return self.model.compute_logits(self.hidden[size, cascade][:batch])          # [B, vocab]

    def release(self) -> None:
        self.graphs.clear()
        self.cascade_graphs.clear()
        self.hidden.clear()
        self.pool = None


# A bucket is kept while its replay on the trial cache takes at most this share of the host's time to launch the
# step eagerly. The trial cache's attention is nearly free, so real steps take the device longer than the replay
# measured: on the H100 llama-3.1-8b's 512-token replay took 10.6 ms on the trial cache, the real step of 568 tokens
# 16.3 ms, as long as eagerly (host 11.7 ms; benchmarks/results/2026-12-07-h100-mixed-step-probe.log). At 0.7 the
# 8B keeps up to 256 tokens (real 312-token step: 10.9 ms graph, 11.9 eager) and qwen3-0.6b all 15 buckets.
MIXED_GRAPH_GAIN = 0.7


class MixedGraphs:
    """One graph per token bucket for steps with prefill chunks: T tokens of B <= max_num_seqs sequences.

    The attention grid depends on the bucket only (AttentionMetadata.tile_maps). At replay the T tokens fill the
    bucket's first rows; the rest form one padding sequence (a fresh prompt of the remaining rows whose block
    table row is all block 0, wide enough for the largest bucket; slots PADDING_SLOT_ID: valid memory, nothing
    written, finite outputs that are dropped), and the sequences after it have no tokens.
    """

    def __init__(self, model, kv_caches, buckets: list[int], max_num_seqs: int, max_blocks_per_seq: int,
                 max_model_len: int, block_size: int, device: torch.device):
        self.model, self.kv_caches, self.max_model_len = model, kv_caches, max_model_len
        self.buckets = list(buckets)
        self.max_num_seqs = max_num_seqs
        size, rows = self.buckets[-1], max_num_seqs + 1           # + the padding sequence
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((size,), PADDING_SLOT_ID, dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(rows + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        width = max(max_blocks_per_seq, -(-size // block_size))       # the padding sequence's blocks too
        self.block_tables = torch.zeros((rows, width), dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self.pool = None

    def _meta(self, size: int) -> AttentionMetadata:
        # a step of `size` tokens has at most `size` sequences, and the padding sequence comes right after them:
        # the rest of the buffers' rows hold no tokens, so the bucket's attention grid leaves them out
        rows = min(self.seq_lens.shape[0], size + 1)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[:rows + 1],
            seq_lens=self.seq_lens[:rows], block_tables=self.block_tables[:rows], max_query_len=size,
            max_seq_len=self.max_model_len, tile_maps={})

    def run(self, size: int) -> torch.Tensor:
        """The bucket's step over the static buffers, eagerly (warm-up, capture, tests) -> hidden [size, hidden]."""
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, self._meta(size))

    def fill_one_sequence(self, size: int) -> None:
        """A warm-up step: every row of the bucket one fresh sequence over block 0, nothing written."""
        self.slot_mapping.fill_(PADDING_SLOT_ID)
        self.query_start_loc.fill_(size)
        self.query_start_loc[0] = 0
        self.seq_lens.zero_()
        self.seq_lens[0] = size
        self.block_tables.zero_()

    def capture(self, size: int, stream: torch.cuda.Stream) -> None:
        """Capture one bucket on `stream` (the caller's capture stream), into the shared pool."""
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.fill_one_sequence(size)
            self.run(size)                          # warm-up: Triton compiles outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                self.hidden[size] = self.run(size)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.current_stream().wait_stream(stream)

    @torch.inference_mode()
    def capture_all(self, stream: torch.cuda.Stream) -> None:
        for size in reversed(self.buckets):         # largest first: later graphs reuse its pool
            self.capture(size, stream)
        torch.cuda.synchronize()

    def bucket_for(self, num_tokens: int, num_seqs: int) -> int | None:
        return None if num_seqs > self.max_num_seqs else smallest_bucket(self.buckets, num_tokens)

    def fill(self, size: int, input_ids, positions, meta: AttentionMetadata) -> None:
        """The step's inputs into the static buffers, the bucket's remaining rows as the padding sequence."""
        num_tokens, num_seqs = input_ids.shape[0], meta.seq_lens.shape[0]
        self.input_ids[:num_tokens].copy_(input_ids)
        self.positions[:num_tokens].copy_(positions)
        self.slot_mapping[:num_tokens].copy_(meta.slot_mapping)
        self.slot_mapping[num_tokens:size].fill_(PADDING_SLOT_ID)
        self.query_start_loc[:num_seqs + 1].copy_(meta.query_start_loc)
        self.query_start_loc[num_seqs + 1:].fill_(size)           # the padding sequence ends the bucket
        self.seq_lens[:num_seqs].copy_(meta.seq_lens)
        self.seq_lens[num_seqs].fill_(size - num_tokens)
        self.seq_lens[num_seqs + 1:].zero_()
        width = meta.block_tables.shape[1]
        self.block_tables[:num_seqs, :width].copy_(meta.block_tables)
        self.block_tables[num_seqs].zero_()

    @torch.inference_mode()
    def replay(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor | None:
        """Hidden states [T, hidden] of the step (a view of the graph's output: read it before the next step
        is launched), or None when no bucket holds it (run it eagerly)."""
        size = self.bucket_for(input_ids.shape[0], meta.seq_lens.shape[0])
        if size is None:
            return None
        self.fill(size, input_ids, positions, meta)
        self.graphs[size].replay()
        return self.hidden[size][:input_ids.shape[0]]

    def release(self) -> None:
        self.graphs.clear()
        self.hidden.clear()
        self.pool = None


def _timed(fn, repeats: int = 3, sync=None) -> tuple[float, float]:
    """(host, wall): the fastest of `repeats` runs of fn from a synchronised start, to fn's return (the host's
    launch time) and to the device's end, in seconds. sync: torch.cuda.synchronize unless given (tests)."""
    sync = sync or torch.cuda.synchronize
    host = wall = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        returned = time.perf_counter()
        sync()
        host, wall = min(host, returned - start), min(wall, time.perf_counter() - start)
    return host, wall


@torch.inference_mode()
def choose_mixed_buckets(graphs: MixedGraphs, stream, timed=_timed) -> list[tuple[int, float, float]]:
    """Time each candidate bucket eagerly (the host's launch time) and as a replayed graph (to the device's end),
    smallest first, and stop at the first whose replay takes more than MIXED_GRAPH_GAIN of the eager launch (the
    device's work, not the host's, bounds the step from there on). Returns [(bucket, eager launch s, replay s)]
    of the kept buckets; the graphs are released. timed: _timed (tests pass a stand-in)."""
    kept = []
    try:
        for size in graphs.buckets:
            graphs.fill_one_sequence(size)
            eager, _ = timed(lambda: graphs.run(size))
            graphs.capture(size, stream)
            _, replay = timed(graphs.graphs[size].replay)
            graphs.graphs.pop(size)
            graphs.hidden.pop(size)
            graphs.pool = None          # its only graph is gone: the next capture starts a pool of its own
            if replay > MIXED_GRAPH_GAIN * eager:
                break
            kept.append((size, eager, replay))
    finally:
        graphs.release()
    return kept
