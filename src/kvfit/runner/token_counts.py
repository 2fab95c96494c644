"""What the penalties read per persistent-batch row: the tokens it generated (and, for a repetition
penalty, its prompt's), in the smaller of two forms (planning.token_history_applies).

- DenseCounts: an int32 [R, vocab] table of output counts | PROMPT_BIT, updated in place each step.
  4 bytes per token id per row: 155 MB at 256 rows of a 151,936-id vocabulary, whether or not any
  request asks for a penalty.
- TokenHistory: the row's token ids themselves, int32 [R, max_model_len + 1] (the last column takes the
  writes of tokens not kept), with how many each row holds and how many of those are its prompt. 4 bytes per
  position: 2 MB at 256 rows of 2,048 tokens. The penalised rows' counts are built when a step needs them,
  for at most sampler_chunk_rows rows at once (the sampler's bound), in the same form DenseCounts keeps.

Both give the penalties the same [P, vocab] int32 (output count | PROMPT_BIT), so the logits, and the tokens,
do not depend on the form. Neither synchronises with the host.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from kvfit.runner.logits_processing import PROMPT_BIT

ToDevice = Callable[[list, torch.dtype], torch.Tensor]     # host values -> a device tensor (SamplingState._to_device)


class DenseCounts:
    """Per-row output-token counts over the vocabulary, PROMPT_BIT on a repetition-penalised row's prompt."""

    def __init__(self, max_num_rows: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.counts = torch.zeros((max_num_rows, vocab_size), dtype=torch.int32, device=device)   # [R, V]

    def reset(self, rows_d: torch.Tensor) -> None:
        """Rows [n] (device int64) hold nothing."""
        self.counts.index_fill_(0, rows_d, 0)

    def set_rows(self, rows: Sequence[int], prompts: Sequence[Sequence[int]],
                 outputs: Sequence[Sequence[int]], to_device: ToDevice) -> None:
        """Rows just reset: their output tokens counted, their prompts (empty: none kept) marked."""
        v = self.vocab_size
        flat = [row * v + t for row, ids in zip(rows, outputs) for t in ids]
        if flat:
            flat_d = to_device(flat, torch.int64)                                         # [sum of lengths]
            self.counts.view(-1).index_add_(0, flat_d, torch.ones_like(flat_d, dtype=torch.int32))
        marked = sorted({row * v + t for row, ids in zip(rows, prompts) for t in ids})  # each token once
        if marked:
            flat_d = to_device(marked, torch.int64)
            self.counts.view(-1).index_add_(0, flat_d, torch.full_like(flat_d, PROMPT_BIT, dtype=torch.int32))

    def add(self, tokens: torch.Tensor, rows: torch.Tensor, kept: torch.Tensor) -> None:
        """tokens [N] (any ids in [0, V)), rows [N] distinct, kept [N] bool: count the kept tokens."""
        self.counts.view(-1).index_add_(0, rows * self.vocab_size + tokens, kept.to(torch.int32))

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """[P, V] int32 (a new tensor: the penalties overwrite it) for rows [P]."""
        return self.counts.index_select(0, rows)

    def dense(self) -> torch.Tensor:
        """Every row's counts [R, V] (tests and diagnostics)."""
        return self.counts


class TokenHistory:
    """Per-row token ids (a repetition-penalised row's prompt first, then its outputs); counts built on demand."""

    def __init__(self, max_num_rows: int, vocab_size: int, max_row_tokens: int, device: torch.device) -> None:
        self.vocab_size, self.max_row_tokens = vocab_size, max_row_tokens
        self.ids = torch.zeros((max_num_rows, max_row_tokens + 1), dtype=torch.int32, device=device)   # [R, L+1]
        self.length = torch.zeros(max_num_rows, dtype=torch.int64, device=device)       # [R] ids held
        self.prompt_length = torch.zeros(max_num_rows, dtype=torch.int64, device=device)   # [R] of them prompt

    def reset(self, rows_d: torch.Tensor) -> None:
        """Rows [n] (device int64) hold nothing: their ids past the lengths are never read."""
        self.length.index_fill_(0, rows_d, 0)
        self.prompt_length.index_fill_(0, rows_d, 0)

    def set_rows(self, rows: Sequence[int], prompts: Sequence[Sequence[int]],
                 outputs: Sequence[Sequence[int]], to_device: ToDevice) -> None:
        """Rows just reset: each row's ids are its prompt (empty: none kept) and then its outputs."""
        width = self.max_row_tokens
        # the engine never gives a row more than max_model_len tokens (admission and the scheduler bound them)
        assert all(len(p) + len(o) <= width for p, o in zip(prompts, outputs)), "a row past max_model_len"
        flat, lengths, prompt_lengths = [], [], []
        for row, prompt, out in zip(rows, prompts, outputs):
            ids = list(prompt) + list(out)
            flat.extend(row * (width + 1) + i for i in range(len(ids)))
            lengths.append(len(ids))
            prompt_lengths.append(len(prompt))
        rows_d = to_device(list(rows), torch.int64)
        self.length[rows_d] = to_device(lengths, torch.int64)
        self.prompt_length[rows_d] = to_device(prompt_lengths, torch.int64)
        if flat:
            values = [t for prompt, out in zip(prompts, outputs) for t in (*prompt, *out)]
            self.ids.view(-1)[to_device(flat, torch.int64)] = to_device(values, torch.int32)

    def add(self, tokens: torch.Tensor, rows: torch.Tensor, kept: torch.Tensor) -> None:
        """As DenseCounts.add: a kept token is appended to its row (a full row's goes to the spare column)."""
        length = self.length.index_select(0, rows)                                         # [N]
        keep = kept & (length < self.max_row_tokens)
        column = torch.where(keep, length, self.max_row_tokens)                           # not kept: the spare column
        self.ids[rows, column] = tokens.to(torch.int32)
        self.length.index_add_(0, rows, keep.to(torch.int64))

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """As DenseCounts.gather, built from the rows' ids: temporaries of about 21 bytes per position and 8 per
        token id of each row, below the sort's 36 bytes a logit that the start-up profile measures."""
        v, width = self.vocab_size, self.max_row_tokens
        ids = self.ids.index_select(0, rows)[:, :width].to(torch.int64)                   # [P, L]
        positions = torch.arange(width, device=ids.device)                                # [L]
        length = self.length.index_select(0, rows)[:, None]                               # [P, 1]
        prompt = self.prompt_length.index_select(0, rows)[:, None]                        # [P, 1]
        flat = ids.add_(torch.arange(rows.shape[0], device=ids.device)[:, None] * v).view(-1)   # [P*L] in [P, V]
        counts = torch.zeros((rows.shape[0], v), dtype=torch.int32, device=ids.device)    # [P, V]
        output = (positions >= prompt) & (positions < length)                             # [P, L] bool
        counts.view(-1).index_add_(0, flat, output.view(-1).to(torch.int32))
        # a prompt token's bit once, however often it occurs: positions outside the prompt fill a spare slot
        spare = counts.numel()
        marks = torch.where((positions < prompt).view(-1), flat, spare)                   # [P*L]
        in_prompt = torch.zeros(spare + 1, dtype=torch.int32, device=ids.device).index_fill_(0, marks, PROMPT_BIT)
        return counts.view(-1).bitwise_or_(in_prompt[:spare]).view(rows.shape[0], v)

    def dense(self) -> torch.Tensor:
        """Every row's counts [R, V], built (a copy: writing to it changes nothing)."""
        return self.gather(torch.arange(self.ids.shape[0], device=self.ids.device))
