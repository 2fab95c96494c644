"""CUDA graphs for decode steps, one per batch-size bucket, replayed with static input buffers.

Captured after the KV cache is allocated (their memory is measured first by a trial capture during
start-up, see platforms/cuda.py). Padded rows write to PADDING_SLOT_ID (skipped by the kernels)
and attend to one token of block 0, so they touch only valid memory. Buckets where the attention backend
would attend a shared prefix once for all sequences (cascade) get a second graph that reads the prefix
length from a static buffer; its padded rows also attend that prefix (row 0's blocks: valid memory, and
their output is dropped).
"""

from __future__ import annotations

from typing import Callable

import torch

from kvfit.attention.base import AttentionMetadata
from kvfit.kv.spec import PADDING_SLOT_ID

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


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
        for size in self.buckets:
            if size >= batch:
                return size
        return None

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
