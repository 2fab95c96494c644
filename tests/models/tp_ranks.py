"""Test helper: the body of one tensor-parallel rank (CPU, gloo), run by torch.multiprocessing.spawn."""

from __future__ import annotations

import torch
import torch.distributed as dist
from paged_batch import PagedCache

from kvfit.attention.torch_ref import TorchReferenceBackend
from kvfit.kv.spec import KVSpec
from kvfit.model_facts import load_model_facts
from kvfit.models.loader import load_model

BLOCK_SIZE, NUM_BLOCKS = 4, 32


def _rank_cache(facts, tp_size: int) -> PagedCache:
    """A PagedCache whose per-layer tensors have this rank's KV heads (KVSpec with tp), NaN-filled."""
    cache = PagedCache(facts, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, seed=1)
    shape = KVSpec.from_model(facts, BLOCK_SIZE, "float32", tp_size).layer_shape(NUM_BLOCKS)
    cache.caches = [(torch.full(shape, float("nan")), torch.full(shape, float("nan")))
                    for _ in range(facts.num_layers)]
    return cache


@torch.inference_mode()
def _prefill_then_decode(model, cache: PagedCache, tokens: list[int], num_prefill: int) -> torch.Tensor:
    ids, pos, meta = cache.step([("s", 0, tokens[:num_prefill])])
    rows = [model.compute_logits(model(ids, pos, cache.caches, meta))]
    for p in range(num_prefill, len(tokens)):
        ids, pos, meta = cache.step([("s", p, tokens[p:p + 1])])
        rows.append(model.compute_logits(model(ids, pos, cache.caches, meta)))
    return torch.cat(rows)                                               # [len(tokens), vocab]


def rank_main(rank: int, world: int, init_file: str, folders: list[str], tokens: list[int], num_prefill: int,
              out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = {}
        for folder in folders:
            facts = load_model_facts(folder)
            model = load_model(folder, facts, torch.float32, "cpu", TorchReferenceBackend(),
                               tp_rank=rank, tp_size=world)
            logits = _prefill_then_decode(model, _rank_cache(facts, world), tokens, num_prefill)
            gathered = [torch.empty_like(logits) for _ in range(world)]
            dist.all_gather(gathered, logits)
            # every rank ends with the full logits, the same on every rank
            assert all(torch.equal(g, logits) for g in gathered), folder
            results[folder] = logits
        if rank == 0:
            torch.save(results, out_file)
    finally:
        dist.destroy_process_group()


def spy_safetensors_reads(monkeypatch) -> list[tuple[str, tuple[int, ...]]]:
    """Patch safetensors.safe_open so the loader's files record each slice it reads, (tensor name, shape read),
    and a whole-tensor read (get_tensor) fails; returns the list the reads land in."""
    from safetensors import safe_open
    reads = []

    class SpyFile:
        def __init__(self, *args, **kwargs):
            self.inner = safe_open(*args, **kwargs)

        def __enter__(self):
            self.fh = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.fh.keys()

        def get_tensor(self, name):
            raise AssertionError(f"{name} was read whole")

        def get_slice(self, name):
            sl = self.fh.get_slice(name)

            class Spy:
                def get_shape(self):
                    return sl.get_shape()

                def get_dtype(self):
                    return sl.get_dtype()

                def __getitem__(self, index):
                    out = sl[index]
                    reads.append((name, tuple(out.shape)))
                    return out
            return Spy()

    monkeypatch.setattr("safetensors.safe_open", SpyFile)
    return reads
