"""ModelRunner: loads the model, runs the profile step, owns the KV cache, executes StepPlans.

It never changes scheduler state: it gets a StepPlan and returns sampled tokens.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvfit.config import EngineConfig
from kvfit.engine.sampling_params import SamplingParams
from kvfit.engine.step_plan import ScheduledSeq, StepPlan
from kvfit.kv.spec import PADDING_SLOT_ID, KVSpec
from kvfit.model_facts import DTYPE_ALIASES, ModelFacts
from kvfit.runner.batch import build_inputs, slot_mapping
from kvfit.runner.kv_cache import TORCH_DTYPES, KVCaches, allocate_kv_caches
from kvfit.runner.sampler import sample, sample_tensor


def model_dtype(config: EngineConfig, facts: ModelFacts) -> torch.dtype:
    name = facts.torch_dtype if config.model.dtype == "auto" else DTYPE_ALIASES[config.model.dtype.lower()]
    return TORCH_DTYPES[name]


class ModelRunner:
    def __init__(self, config: EngineConfig, facts: ModelFacts, device: torch.device, backend, spec: KVSpec,
                 tp_rank: int = 0):
        self.config = config
        self.facts = facts
        self.device = device
        self.backend = backend
        self.spec = spec
        self.tp_rank = tp_rank
        self.dtype = model_dtype(config, facts)
        self.model = None
        self.kv_caches: KVCaches = []
        self.graphs = None
        self._capture_stream = None
        # --seed: dummy weights and unseeded sampling repeat from run to run
        torch.manual_seed(config.model.seed)

    def load_model(self) -> int:
        """Load weights; return their bytes on this rank."""
        from kvfit.models.loader import load_model
        self.model = load_model(self.config.model.model, self.facts, self.dtype, self.device, self.backend,
                                load_format=self.config.model.load_format,
                                tp_rank=self.tp_rank, tp_size=self.config.parallel.tensor_parallel_size)
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def profile_run(self) -> int:
        """The step shapes with the largest activations: max_num_batched_tokens tokens split over
        max_num_seqs sequences (sampling every one), and as few sequences as max_model_len allows
        (the longest prefills). Both run on one scratch cache just big enough for the larger;
        returns the scratch cache's bytes so the platform can leave them out of the activation peak.
        """
        sched = self.config.scheduler
        max_len = self._max_model_len()
        num_tokens = min(sched.max_num_batched_tokens, sched.max_num_seqs * max_len)
        wide = max(min(sched.max_num_seqs, num_tokens), 1)
        long = max(-(-num_tokens // max_len), 1)
        plans = [self._profile_plan(num_tokens, n) for n in dict.fromkeys((wide, long))]
        num_blocks = max(max(s.block_ids[-1] for s in plan.seqs) + 1 for plan in plans)
        scratch = allocate_kv_caches(self.spec, num_blocks, self.device)
        try:
            for plan in plans:
                self._execute(plan, scratch)
        finally:
            del scratch
        return num_blocks * self.spec.bytes_per_block

    def _profile_plan(self, num_tokens: int, num_seqs: int) -> StepPlan:
        per_seq = [num_tokens // num_seqs + (1 if i < num_tokens % num_seqs else 0) for i in range(num_seqs)]
        bs = self.spec.block_size
        seqs, next_block = [], 0
        for i, n in enumerate(per_seq):
            blocks = tuple(range(next_block, next_block + -(-n // bs)))
            next_block += len(blocks)
            seqs.append(ScheduledSeq(request_id=f"profile-{i}", token_ids=tuple([0] * n), start_pos=0,
                                     block_ids=blocks, sample=True, params=SamplingParams(temperature=0),
                                     num_generated=0))
        return StepPlan(seqs=tuple(seqs))

    def _max_model_len(self) -> int:
        from kvfit.kv.limits import resolve_max_model_len
        return resolve_max_model_len(self.facts, self.config.model.max_model_len)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(self.spec, num_blocks, self.device)

    # CUDA graphs -------------------------------------------------------------------------------
    def _graphs_enabled(self) -> bool:
        return self.device.type == "cuda" and not self.config.device.enforce_eager

    def _new_graphs(self, kv_caches: KVCaches):
        from kvfit.runner.cuda_graphs import DecodeGraphs
        max_len = self._max_model_len()
        return DecodeGraphs(self.model, kv_caches, self.config.scheduler.max_num_seqs,
                            self.spec.num_blocks_for_tokens(max_len), max_len, self.device)

    def trial_capture_graphs(self) -> None:
        """Capture on a one-block scratch cache so the platform can measure the graphs' memory."""
        if not self._graphs_enabled():
            return
        self.graphs = self._new_graphs(allocate_kv_caches(self.spec, 1, self.device))
        self.graphs.capture(self._stream())

    def _stream(self):
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(self.device)
        return self._capture_stream

    def release_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.release()
        self.graphs = None

    def capture_graphs(self) -> None:
        """Capture the decode graphs over the real KV cache (after allocate_kv_cache)."""
        self.release_graphs()
        if self._graphs_enabled():
            self.graphs = self._new_graphs(self.kv_caches)
            self.graphs.capture(self._stream())

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> dict[str, int]:
        """Run one step; return {request_id: sampled token} for the seqs that sample."""
        if self.graphs is not None and self._is_graph_step(plan):
            # a one-step graph decode is a multi-step round of one step
            return {request_id: tokens[0] for request_id, tokens in self.execute_steps(plan).items()}
        return self._execute(plan, self.kv_caches)

    def _is_graph_step(self, plan: StepPlan) -> bool:
        return (len(plan.seqs) <= self.graphs.buckets[-1]
                and all(len(s.token_ids) == 1 and s.sample for s in plan.seqs))

    @torch.inference_mode()
    def execute_steps(self, plan: StepPlan) -> dict[str, list[int]]:
        """Run a multi-step decode plan: sequence i runs plan.seqs[i].num_steps decode steps, each
        step's sampled tokens feeding the next on the device; one host sync at the end.

        Returns {request_id: its sampled tokens, in order}. A sequence past its last step keeps
        running with the batch (its row writes to PADDING_SLOT_ID and its samples are dropped).
        """
        seqs = plan.seqs
        bs = self.spec.block_size
        inputs = build_inputs(plan, bs, self.device)
        meta = inputs.meta
        steps = [s.num_steps for s in seqs]
        num_steps = max(steps)
        ids, positions, seq_lens, slots = inputs.input_ids, inputs.positions, meta.seq_lens, meta.slot_mapping
        tables = meta.block_tables                                                              # [B, W]
        tokens = torch.empty((num_steps, len(seqs)), dtype=torch.int64, device=self.device)      # [K, B]
        params = [s.params for s in seqs]
        for k in range(num_steps):
            step_meta = replace(meta, slot_mapping=slots, seq_lens=seq_lens, max_seq_len=meta.max_seq_len + k,
                                seq_lens_host=[n + min(k, m - 1) for n, m in zip(meta.seq_lens_host, steps)])
            logits = self._decode_logits(ids, positions, step_meta)                             # [B, vocab]
            tokens[k] = sample_tensor(logits, params, [s.num_generated + k for s in seqs])
            del logits              # one step's logits alive at a time, as in the profiled step
            if k + 1 == num_steps:
                break
            if k == 0:          # only a round of several steps needs these (not a one-step decode)
                remaining = torch.tensor(steps, dtype=torch.int32).to(self.device, non_blocking=True)   # [B]
                rows = torch.arange(len(seqs), device=self.device)                                      # [B]
            active = remaining > k + 1                                                          # [B] bool
            ids = tokens[k]
            positions = positions + active
            seq_lens = seq_lens + active.to(seq_lens.dtype)
            slots = torch.where(active, slot_mapping(tables, rows, positions, bs), PADDING_SLOT_ID)
        if self.tp_rank != 0:
            return {}       # every rank computes the logits (the lm_head all-gathers them); rank 0 samples
        sampled = tokens.t().tolist()
        return {s.request_id: row[:s.num_steps] for s, row in zip(seqs, sampled)}

    def _decode_logits(self, ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        # ids, positions: [B]; one decode token per sequence -> logits [B, vocab]
        if self.graphs is not None and ids.shape[0] <= self.graphs.buckets[-1]:
            return self.graphs.replay(ids, positions, meta.slot_mapping, meta.seq_lens, meta.block_tables)
        return self.model.compute_logits(self.model(ids, positions, self.kv_caches, meta))

    @torch.inference_mode()
    def _execute(self, plan: StepPlan, kv_caches: KVCaches) -> dict[str, int]:
        if plan.empty:
            return {}
        inputs = build_inputs(plan, self.spec.block_size, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, kv_caches, inputs.meta)   # [T, hidden]
        if not inputs.sample_rows:
            return {}
        rows = torch.tensor(inputs.sample_rows, device=self.device)
        logits = self.model.compute_logits(hidden[rows])                                  # [N, vocab]
        if self.tp_rank != 0:
            return {}       # every rank computes the logits (the lm_head all-gathers them); rank 0 samples
        seqs = [plan.seqs[i] for i in inputs.sample_seqs]
        tokens = sample(logits, [s.params for s in seqs], [s.num_generated for s in seqs])
        return {s.request_id: t for s, t in zip(seqs, tokens)}
