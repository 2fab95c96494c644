"""The persistent batch: per-request rows kept by the runner and updated from each StepDelta.

A request takes a row when it first reaches the runner and keeps it until it finishes or is
preempted. Its block-table row lives on the device and is only ever appended to (one scatter of
the step's new block ids, never a rebuild); its sampling parameters live in SamplingState rows;
its token ids (prompt + sampled) and counters live on the host, where the step's inputs are read.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvfit.planning import persistent_batch_bytes
from kvfit.runner.logits_processing import RowExtras
from kvfit.runner.sampling_state import SamplingState
from kvfit.step import NewRequest, StepDelta


class CachedRequest:
    """The runner's view of one request."""

    __slots__ = ("request_id", "row", "token_ids", "num_prompt_tokens", "num_computed_tokens", "num_blocks",
                 "num_prompt_logprobs", "num_pending")

    def __init__(self, new: NewRequest, row: int):
        self.request_id = new.request_id
        self.row = row
        self.token_ids = list(new.prompt_token_ids) + list(new.output_token_ids)
        self.num_prompt_tokens = len(new.prompt_token_ids)
        self.num_computed_tokens = new.num_computed_tokens
        self.num_blocks = len(new.block_ids)
        self.num_prompt_logprobs = new.params.prompt_logprobs     # None: not asked
        # tokens sampled by launched steps but not yet recorded (async scheduling: still on the device)
        self.num_pending = 0

    @property
    def num_tokens(self) -> int:
        """Known tokens plus those sampled on the device and not yet recorded."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_generated(self) -> int:
        return self.num_tokens - self.num_prompt_tokens


class InputBatch:
    """Rows for up to max_num_rows requests; block tables of up to max_blocks_per_row blocks each."""

    def __init__(self, max_num_rows: int, max_blocks_per_row: int, vocab_size: int, device: torch.device,
                 with_sampling: bool = True, max_model_len: int | None = None):
        self.device = device
        self.max_num_rows = max_num_rows
        self.max_blocks_per_row = max_blocks_per_row
        self.vocab_size = vocab_size
        self.block_table = torch.zeros((max_num_rows, max_blocks_per_row), dtype=torch.int32,
                                       device=device)                                    # [R, W]
        # only the rank that samples keeps sampling rows (tensor parallelism: rank 0)
        self.max_model_len = max_model_len
        self.sampling = SamplingState(max_num_rows, vocab_size, device, max_model_len) if with_sampling else None
        self.requests: dict[str, CachedRequest] = {}
        self._free_rows = list(range(max_num_rows - 1, -1, -1))     # a stack: low rows first

    @property
    def num_bytes(self) -> int:
        """Device bytes this batch holds: planning.persistent_batch_bytes (tested equal to the tensors)."""
        return persistent_batch_bytes(self.max_num_rows, self.max_blocks_per_row, self.vocab_size,
                                      self.sampling is not None, self.max_model_len)

    def apply(self, delta: StepDelta) -> None:
        """Drop ended requests, add new ones, append new block ids: the whole delta, in that order."""
        self._remove(delta.removed_ids)
        writes: list[tuple[int, int, Sequence[int]]] = []          # (row, first column, block ids)
        added = [self._add(new) for new in delta.new_requests]
        for req, new in zip(added, delta.new_requests):
            writes.append((req.row, 0, new.block_ids))
        for request_id, block_ids in zip(delta.request_ids, delta.new_block_ids):
            if block_ids:
                req = self.requests[request_id]
                writes.append((req.row, req.num_blocks, block_ids))
                req.num_blocks += len(block_ids)
        self._write_blocks(writes)
        if self.sampling is not None and added:
            extras = [RowExtras(prompt_token_ids=n.prompt_token_ids, eos_token_ids=n.eos_token_ids,
                                bad_words_token_ids=n.bad_words_token_ids, history=r.token_ids)
                      for r, n in zip(added, delta.new_requests)]
            self.sampling.set_rows([r.row for r in added], [n.params for n in delta.new_requests],
                                   [n.output_token_ids for n in delta.new_requests], extras)

    def _remove(self, request_ids: Sequence[str]) -> None:
        rows = []
        for request_id in request_ids:
            req = self.requests.pop(request_id, None)      # unknown: never reached the runner
            if req is not None:
                rows.append(req.row)
                self._free_rows.append(req.row)
        if rows and self.sampling is not None:
            self.sampling.clear_rows(rows)

    def _add(self, new: NewRequest) -> CachedRequest:
        assert new.request_id not in self.requests, f"request {new.request_id!r} is already in the batch"
        assert self._free_rows, "more requests than max_num_seqs rows"
        assert len(new.block_ids) <= self.max_blocks_per_row, "a table longer than max_model_len"
        req = CachedRequest(new, self._free_rows.pop())
        self.requests[new.request_id] = req
        return req

    def _write_blocks(self, writes: list[tuple[int, int, Sequence[int]]]) -> None:
        """One host-to-device copy and one scatter for every block id the delta appends."""
        if not writes:
            return
        rows, cols, values = [], [], []
        for row, first, block_ids in writes:
            assert first + len(block_ids) <= self.max_blocks_per_row, "a table longer than max_model_len"
            rows.extend([row] * len(block_ids))
            cols.extend(range(first, first + len(block_ids)))
            values.extend(block_ids)
        # block ids pass 2^31 only past 2^31 blocks: int32 like the table (KVSpec bounds the count)
        packed = torch.tensor([rows, cols, values], dtype=torch.int64).to(self.device, non_blocking=True)
        self.block_table[packed[0], packed[1]] = packed[2].to(torch.int32)

    def record_sampled(self, sampled: dict[str, list[int]]) -> None:
        """Append tokens sampled for requests still in the batch (tensor-parallel ranks learn rank 0's
        tokens this way, one step late but before they are needed as inputs)."""
        for request_id, tokens in sampled.items():
            req = self.requests.get(request_id)
            if req is not None:
                req.token_ids.extend(tokens)
                req.num_pending = max(0, req.num_pending - len(tokens))

    def mark_pending(self, delta: StepDelta, sample_seqs: Sequence[int]) -> None:
        """The delta is launched: its sampling requests will have steps_of(i) more tokens once recorded."""
        for i in sample_seqs:
            self.requests[delta.request_ids[i]].num_pending += delta.steps_of(i)

    def advance(self, delta: StepDelta) -> None:
        """After the step ran: the tokens each scheduled request computed are in the cache."""
        for index, request_id in enumerate(delta.request_ids):
            self.requests[request_id].num_computed_tokens += delta.num_scheduled_tokens[index] + delta.steps_of(index) - 1
