"""Prompt logprobs: the log probability of every prompt token given the ones before it, in bounded slices.

A prefill step's hidden states at positions p (of the computed chunk) give the logits that predict
token p + 1; the prompt's last position predicts the first output token (the sample), so positions
p < num_prompt_tokens - 1 yield prompt logprobs. Logits are computed PROMPT_LOGPROBS_SLICE positions at a
time, so their peak is bounded whatever the chunk length (the profile runs a slice at its widest).
Chunked prefill yields a prompt's entries chunk by chunk; the engine places them by position. Prefix-cache
hits would skip positions, so such requests are never given a prefix-cache hit (the scheduler, as vLLM).

Every tensor-parallel rank computes the same slices (the LM head all-gathers); rank 0 keeps the values.
"""

from __future__ import annotations

from typing import Callable

import torch

from kvfit.runner.logits_processing import pack_logprobs, top_logprobs, unpack_logprobs
from kvfit.sampling_params import PROMPT_LOGPROBS_SLICE
from kvfit.step import TokenLogprobs


def prompt_logprob_positions(num_computed: int, num_scheduled: int, num_prompt_tokens: int) -> tuple[int, int]:
    """The chunk's positions [first, end) whose next token is a prompt token (empty when first >= end)."""
    return num_computed, min(num_computed + num_scheduled, num_prompt_tokens - 1)


def compute_prompt_logprobs(hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor],
                            jobs: list[tuple[str, int, int, int, list[int], int]], keep: bool,
                            to_host: Callable[[torch.Tensor], torch.Tensor],
                            slice_positions: int = PROMPT_LOGPROBS_SLICE,
                            ) -> Callable[[], dict[str, tuple[int, list[TokenLogprobs]]]]:
    """jobs: (request_id, first hidden row, first position, count, the request's token ids, k).

    Launches the work and returns what reads it: {request_id: (first target position, entries)} where the
    entry for target position t = p + 1 is prompt token t given tokens < t; {} when not keep (ranks other
    than 0 compute logits only); slice_positions: positions whose logits exist at once (planning.
    prompt_logprobs_slice). to_host starts the one device-to-host copy (the runner's: pinned, not
    blocking); the reader must run after it has landed."""
    packed, spans = [], []
    for request_id, row, first, count, token_ids, k in jobs:
        for start in range(0, count, slice_positions):
            n = min(slice_positions, count - start)
            logits = compute_logits(hidden[row + start:row + start + n])                 # [n, V]
            if not keep:
                continue
            targets = torch.tensor(token_ids[first + start + 1:first + start + 1 + n],
                                   dtype=torch.int64).to(logits.device, non_blocking=True)   # [n]
            packed.append(pack_logprobs(*top_logprobs(logits, k), logits, targets))      # [n, 3 + 2k]
            del logits
        spans.append((request_id, first + 1, count, k))
    if not keep or not packed:
        return dict
    width = max(p.shape[1] for p in packed)
    host = to_host(torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) if p.shape[1] < width else p
                              for p in packed]))                                         # one copy

    def read() -> dict[str, tuple[int, list[TokenLogprobs]]]:
        rows, out, at = host.tolist(), {}, 0
        for request_id, first_target, count, k in spans:
            out[request_id] = (first_target, _unpack_padded(rows[at:at + count], k))
            at += count
        return out
    return read


def _unpack_padded(rows: list[list[float]], k: int) -> list[TokenLogprobs]:
    # a row padded on the right: its own width is 3 + 2k
    return unpack_logprobs([row[:3 + 2 * k] for row in rows], [k] * len(rows))
