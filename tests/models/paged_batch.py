"""Test helper: a paged KV cache with scattered block ids, and the flat batch + metadata of one step."""

from __future__ import annotations

import random

import torch

from kvfit.attention.base import AttentionMetadata
from kvfit.kv.spec import KVSpec

TORCH_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class PagedCache:
    """Per-layer K/V caches filled with NaN (a read of an unwritten slot poisons the output)
    and per-sequence block tables drawn from a shuffled free list (non-contiguous block ids)."""

    def __init__(self, facts, block_size: int = 4, num_blocks: int = 64, dtype=torch.float32, seed: int = 0):
        self.spec = KVSpec.from_model(facts, block_size=block_size, kv_cache_dtype=TORCH_DTYPE_NAMES[dtype])
        shape = self.spec.layer_shape(num_blocks)
        self.caches = [(torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype))
                       for _ in range(facts.num_layers)]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}

    def _slot(self, seq: str, pos: int) -> int:
        table = self.tables.setdefault(seq, [])
        bs = self.spec.block_size
        while len(table) <= pos // bs:
            table.append(self.free.pop())
        return table[pos // bs] * bs + pos % bs

    def step(self, chunks: list[tuple[str, int, list[int]]]):
        """chunks: (seq id, start position, new token ids) per sequence -> (input_ids, positions, meta)."""
        ids, positions, slots, starts, seq_lens = [], [], [], [0], []
        for seq, start, tokens in chunks:
            ids += tokens
            positions += range(start, start + len(tokens))
            slots += [self._slot(seq, p) for p in range(start, start + len(tokens))]
            starts.append(starts[-1] + len(tokens))
            seq_lens.append(start + len(tokens))
        width = max(len(self.tables[seq]) for seq, _, _ in chunks)
        table = torch.zeros((len(chunks), width), dtype=torch.int32)      # [B, max_blocks]
        for i, (seq, _, _) in enumerate(chunks):
            table[i, :len(self.tables[seq])] = torch.tensor(self.tables[seq], dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=table,
            max_query_len=max(len(t) for _, _, t in chunks), max_seq_len=max(seq_lens),
            query_start_loc_host=starts, seq_lens_host=seq_lens)
        return torch.tensor(ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64), meta


def random_tokens(vocab_size: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (n,), generator=g).tolist()


@torch.inference_mode()
def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    """transformers' logits [L, vocab] float32 for one sequence run alone."""
    return hf_model(torch.tensor([tokens])).logits[0].float()


@torch.inference_mode()
def step_logits(model, cache: PagedCache, chunks) -> list[torch.Tensor]:
    """One step of `chunks` through `model` over `cache`: the logits [len(tokens), vocab] of each chunk."""
    input_ids, positions, meta = cache.step(chunks)
    logits = model.compute_logits(model(input_ids, positions, cache.caches, meta))    # [T, vocab]
    starts = meta.query_start_loc_host
    return [logits[a:b] for a, b in zip(starts[:-1], starts[1:])]
