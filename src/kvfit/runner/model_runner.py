"""ModelRunner: loads the model, runs the profile step, owns the KV cache and the persistent batch.

It never changes scheduler state: it applies each StepDelta to its persistent batch (kvfit/step.py)
and returns the sampled tokens.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import replace
from typing import Callable

import torch

from kvfit.config import EngineConfig
from kvfit.kernels import pdl
from kvfit.kv.spec import PADDING_SLOT_ID, KVSpec
from kvfit.model_facts import ModelFacts
from kvfit.models.kv_scales import kv_scale_layers
from kvfit.planning import (mixed_buckets, prompt_logprobs_slice, resolve_max_logprobs, resolve_max_model_len,
                             resolve_model_dtype)
from kvfit.platforms.base import Platform
from kvfit.runner.batch import ModelInputs, build_inputs, slot_mapping
from kvfit.runner.input_batch import InputBatch
from kvfit.runner.kv_cache import TORCH_DTYPES, KVCaches, allocate_kv_caches
from kvfit.runner.logits_processing import unpack_logprobs
from kvfit.runner.prompt_logprobs import compute_prompt_logprobs, prompt_logprob_positions
from kvfit.runner.sampling_state import NONFINITE_TOKEN, SampleResult
from kvfit.sampling_params import MAX_LOGPROBS, SamplingParams
from kvfit.structured.bitmask import bitmask_words
from kvfit.step import NewRequest, SampledTokens, StepDelta

logger = logging.getLogger("kvfit")

# The sampler's most expensive rows, for the profile: seeded (hashed noise) with top-p and no top-k
# (a full sort of the vocabulary), min_p, every penalty (the edited fp32 copy and the counts' temporaries),
# a logit bias, the most top-k logprobs (--max-logprobs: profile_sampling), prompt logprobs
# (planning.prompt_logprobs_slice positions of logits at a time) and a grammar bitmask on every row (_profile_delta).
# Every row of the profiled steps uses them, so enabling any of them never takes more than the measured
# activation peak.
PROFILE_SAMPLING = SamplingParams(temperature=1.0, top_p=0.9, seed=0, min_p=0.01, repetition_penalty=1.1,
                                  presence_penalty=0.1, frequency_penalty=0.1, logit_bias={0: 1.0},
                                  logprobs=MAX_LOGPROBS, prompt_logprobs=MAX_LOGPROBS)


def profile_sampling(max_logprobs: int) -> SamplingParams:
    """PROFILE_SAMPLING asking for the most logprobs and prompt logprobs a request may (--max-logprobs)."""
    return replace(PROFILE_SAMPLING, logprobs=max_logprobs, prompt_logprobs=max_logprobs)


def model_dtype(config: EngineConfig, facts: ModelFacts) -> torch.dtype:
    return TORCH_DTYPES[resolve_model_dtype(facts, config.model.dtype)]


def _pdl_as_configured(method):
    """The runner method with the config's PDL setting (DeviceConfig.pdl) in force for the kernels it launches."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with pdl.setting(self.config.device.pdl):
            return method(self, *args, **kwargs)
    return run


class ModelRunner:
    def __init__(self, config: EngineConfig, facts: ModelFacts, platform: Platform, backend, spec: KVSpec,
                 tp_rank: int = 0):
        self.config = config
        self.facts = facts
        self.platform = platform                 # device questions (host copies, events, the allocator cache)
        self.device = platform.torch_device()
        self.backend = backend
        self.spec = spec
        self.tp_rank = tp_rank
        self.dtype = model_dtype(config, facts)
        self.max_model_len = resolve_max_model_len(facts, config.model.max_model_len)
        self.use_graphs = platform.supports_graphs and not config.device.enforce_eager
        # a decode step's shared prefix attended once for all sequences, where the backend would; prefix caching
        # finds shared prefixes (StepDelta.num_common_prefix_blocks), so without it no cascade graphs either
        cascade = config.cache.enable_prefix_caching and not config.device.disable_cascade_attn
        self._cascade_tokens = backend.cascade_tokens if cascade else None
        self.model = None
        self.batch: InputBatch | None = None
        self.kv_caches: KVCaches = []
        self.graphs = None
        # steps with prefill chunks as graphs (runner/cuda_graphs.py MixedGraphs), where the backend's attention
        # takes them; their buckets are chosen by timing at the trial capture (None: not chosen yet)
        self.mixed_graphs = None
        self._mixed_buckets: list[int] | None = None if getattr(backend, "graphs_any_step", False) else []
        self._kv_scales: list = []            # every attention layer's fp8 KV cache scales (models/kv_scales.py)
        self._kv_scales_pending = False       # --calculate-kv-scales set up, no batch has set the scales yet
        self._capture_stream = None
        # the last decode round's final tokens on the device: ({request_id: column}, [B] int64)
        self._carry: tuple[dict[str, int], torch.Tensor] | None = None
        # --seed: dummy weights and unseeded sampling repeat from run to run
        torch.manual_seed(config.model.seed)

    @_pdl_as_configured
    def load_model(self) -> int:
        """Load weights; return their bytes on this rank."""
        from kvfit.models.loader import load_model
        self.model = load_model(self.config.model.model, self.facts, self.dtype, self.device, self.backend,
                                load_format=self.config.model.load_format,
                                tp_rank=self.tp_rank, tp_size=self.config.parallel.tensor_parallel_size)
        self._kv_scales = kv_scale_layers(self.model)
        if self.config.cache.calculate_kv_scales:       # the scaled path in the profile and in the graphs
            for scales in self._kv_scales:
                scales.enable_calculation()
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def _new_batch(self) -> InputBatch:
        # rank 0 samples (every rank computes the logits: the lm_head all-gathers them)
        return InputBatch(self.config.scheduler.max_num_seqs, self.spec.num_blocks_for_tokens(self.max_model_len),
                          self.facts.vocab_size, self.device, with_sampling=self.tp_rank == 0,
                          max_model_len=self.max_model_len)

    @_pdl_as_configured
    def profile_run(self) -> int:
        """The step shapes with the largest activations: max_num_batched_tokens tokens split over
        max_num_seqs sequences (sampling every one), and as few sequences as max_model_len allows
        (the longest prefills). Both run on one scratch cache just big enough for the larger;
        returns the scratch cache's bytes so the platform can leave them out of the activation peak.
        The persistent batch is allocated first, so the peak includes it.
        """
        self.batch = self.batch or self._new_batch()
        sched = self.config.scheduler
        max_len = self.max_model_len
        num_tokens = min(sched.max_num_batched_tokens, sched.max_num_seqs * max_len)
        warm_up = getattr(self.model, "warm_up", None)     # kernels with per-size configs compile here
        if warm_up is not None:
            warm_up(num_tokens)
        wide = max(min(sched.max_num_seqs, num_tokens), 1)
        long = max(-(-num_tokens // max_len), 1)
        deltas = [self._profile_delta(num_tokens, n) for n in dict.fromkeys((wide, long))]
        num_blocks = max(max(r.block_ids[-1] for r in d.new_requests) + 1 for d in deltas)
        scratch = allocate_kv_caches(self.spec, num_blocks, self.device)
        try:
            for delta in deltas:
                self._execute(delta, scratch)()
                self.batch.apply(StepDelta(finished_ids=delta.request_ids))
        finally:
            del scratch
        return num_blocks * self.spec.bytes_per_block

    def _profile_delta(self, num_tokens: int, num_seqs: int) -> StepDelta:
        per_seq = [num_tokens // num_seqs + (1 if i < num_tokens % num_seqs else 0) for i in range(num_seqs)]
        sampling = profile_sampling(resolve_max_logprobs(self.facts, self.config.model.max_logprobs))
        new, next_block = [], 0
        for i, n in enumerate(per_seq):
            blocks = tuple(range(next_block, next_block + self.spec.num_blocks_for_tokens(n)))
            next_block += len(blocks)
            new.append(NewRequest(request_id=f"profile-{i}", prompt_token_ids=(0,) * n, output_token_ids=(),
                                  params=sampling, block_ids=blocks, num_computed_tokens=0))
        allow_all = bytes([0xFF]) * (4 * bitmask_words(self.facts.vocab_size))    # a grammar row allowing all
        return StepDelta(request_ids=tuple(r.request_id for r in new), num_scheduled_tokens=tuple(per_seq),
                         new_block_ids=((),) * len(new), new_requests=tuple(new),
                         token_bitmasks={r.request_id: allow_all for r in new})

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(self.spec, num_blocks, self.device)

    # CUDA graphs -------------------------------------------------------------------------------
    def _new_graphs(self, kv_caches: KVCaches):
        from kvfit.runner.cuda_graphs import DecodeGraphs
        return DecodeGraphs(self.model, kv_caches, self.config.scheduler.max_num_seqs,
                            self.spec.num_blocks_for_tokens(self.max_model_len), self.max_model_len, self.device,
                            self._cascade_tokens)

    def _new_mixed_graphs(self, kv_caches: KVCaches, buckets: list[int]):
        from kvfit.runner.cuda_graphs import MixedGraphs
        return MixedGraphs(self.model, kv_caches, buckets, self.config.scheduler.max_num_seqs,
                           self.spec.num_blocks_for_tokens(self.max_model_len), self.max_model_len,
                           self.spec.block_size, self.device)

    def _choose_mixed_buckets(self, kv_caches: KVCaches) -> list[int]:
        """The token buckets whose mixed-step graphs beat the eager step here, timed on the trial cache."""
        from kvfit.runner.cuda_graphs import choose_mixed_buckets
        tp = self.config.parallel.tensor_parallel_size > 1
        candidates = mixed_buckets(self.config.scheduler.max_num_batched_tokens, tp)
        if not candidates:
            return []
        if tp:          # every rank must replay the same graphs (collectives): no per-rank timing
            return candidates
        kept = choose_mixed_buckets(self._new_mixed_graphs(kv_caches, candidates), self._stream())
        self.platform.release_cached_memory()        # the timing's graphs are not part of the measured pool
        logger.info("CUDA graphs for steps with prefill chunks: %s", ", ".join(
            f"{size} tokens ({eager * 1e3:.1f} -> {replay * 1e3:.1f} ms)" for size, eager, replay in kept)
            if kept else f"none (the {candidates[0]}-token graph was not faster than the eager step)")
        return [size for size, _, _ in kept]

    def _capture(self, kv_caches: KVCaches) -> None:
        """Capture the mixed-step graphs (largest first), then the decode graphs, in one pool."""
        stream = self._stream()
        if self._mixed_buckets is None:
            self._mixed_buckets = self._choose_mixed_buckets(kv_caches)
        self.graphs = self._new_graphs(kv_caches)
        if self._mixed_buckets:
            self.mixed_graphs = self._new_mixed_graphs(kv_caches, self._mixed_buckets)
            self.mixed_graphs.capture_all(stream)
            self.graphs.pool = self.mixed_graphs.pool
        self.graphs.capture(stream)
        # each capture's eager warm-up left its activations cached on the capture stream; they belong to the
        # activation peak, not to the graphs, so the trial capture would count them twice (fewer KV blocks: on the
        # H100 the 0.6B planned 644,300 KV tokens with the mixed graphs, 644,976 before them), and after the real
        # capture no step allocates on that stream (the worker then holds the activation reserve on the steps')
        self.platform.release_cached_memory()

    @_pdl_as_configured
    def trial_capture_graphs(self) -> None:
        """Capture on a one-block scratch cache so the platform can measure the graphs' memory."""
        if not self.use_graphs:
            return
        self._capture(allocate_kv_caches(self.spec, 1, self.device))

    def _stream(self):
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(self.device)
        return self._capture_stream

    def release_graphs(self) -> None:
        for graphs in (self.graphs, self.mixed_graphs):
            if graphs is not None:
                graphs.release()
        self.graphs = self.mixed_graphs = None

    def release(self) -> None:
        """Drop the weights, the KV cache, the graphs and the persistent batch (the engine shut down)."""
        self.release_graphs()
        self.model, self.batch, self.kv_caches, self._carry = None, None, [], None
        self.platform.release_cached_memory()

    @_pdl_as_configured
    def capture_graphs(self) -> None:
        """Capture the CUDA graphs (mixed steps, decode) over the real KV cache (after allocate_kv_cache)."""
        self.release_graphs()
        if self.use_graphs:
            self._capture(self.kv_caches)
        if self.config.cache.calculate_kv_scales:       # the first batch from now on sets them (eagerly)
            for scales in self._kv_scales:
                scales.calculate_next = True
            self._kv_scales_pending = True

    # steps -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, delta: StepDelta, sampled_before: dict[str, list[int]] | None = None) -> SampledTokens:
        """Apply the delta to the persistent batch and run it; return the sampled tokens (one per device
        step; rank 0 only). sampled_before: {request_id: tokens} rank 0 sampled in the previous step
        (tensor parallelism), recorded first."""
        if sampled_before:
            self.batch.record_sampled(sampled_before)
        return self.launch(delta)()

    @_pdl_as_configured
    @torch.inference_mode()
    def launch(self, delta: StepDelta) -> Callable[[], SampledTokens]:
        """Apply the delta and put its work on the device; return what reads its tokens (the one host
        sync) and records them. Async scheduling launches the next delta (`continues`) before
        reading this one's tokens, so the device never waits for the host in between."""
        finish = self._execute(delta, self.kv_caches)

        def result() -> SampledTokens:
            with torch.inference_mode():
                sampled = finish()
            self.batch.record_sampled(sampled.tokens)
            return sampled
        return result

    def _execute(self, delta: StepDelta, kv_caches: KVCaches) -> Callable[[], SampledTokens]:
        self.batch.apply(delta)
        if delta.empty:
            return SampledTokens
        inputs = build_inputs(self.batch, delta, self.spec.block_size, self._cascade_tokens)
        if inputs.carried:
            inputs = replace(inputs, input_ids=self._carried_inputs(delta, inputs))
        self.batch.mark_pending(delta, inputs.sample_seqs)
        self._carry = None
        if kv_caches is self.kv_caches and self._is_decode(delta, inputs):
            finish = self._execute_steps(delta, inputs)     # a one-step decode is a round of one
        else:
            finish = self._execute_one(delta, inputs, kv_caches)
        self.batch.advance(delta)
        return finish

    def _carried_inputs(self, delta: StepDelta, inputs: ModelInputs) -> torch.Tensor:
        """A `continues` delta's input ids: the carried requests' tokens are those the step in flight sampled
        for them (still on the device), the rest as built."""
        assert self._carry is not None, "a carried input without a step in flight that sampled it"
        index, last = self._carry
        starts = inputs.meta.query_start_loc_host
        picks = [index[delta.request_ids[i]] for i in inputs.carried]
        if len(picks) == len(inputs.input_ids):                 # every input (a decode round): no scatter
            return last[torch.tensor(picks, dtype=torch.int64).to(self.device, non_blocking=True)]
        host = torch.tensor([picks, [starts[i] for i in inputs.carried]], dtype=torch.int64)
        picks_d, rows = host.to(self.device, non_blocking=True)
        return inputs.input_ids.index_copy(0, rows, last[picks_d])

    @staticmethod
    def _is_decode(delta: StepDelta, inputs: ModelInputs) -> bool:
        """One token for every request, each sampled: the step runs as a decode round (graphs where
        they cover the batch) and leaves its last tokens on the device for a `continues` delta."""
        return delta.num_tokens == len(delta.request_ids) and len(inputs.sample_seqs) == len(delta.request_ids)

    def _sample(self, logits: torch.Tensor, inputs: ModelInputs, delta: StepDelta, step: int = 0,
                counted: torch.Tensor | None = None) -> SampleResult:
        # logits [N, vocab] -> tokens [N] (and packed logprobs) on the device, no host sync
        generated = inputs.num_generated + step if step else inputs.num_generated
        masked, bitmask = self._bitmask_rows(delta, inputs) if step == 0 else ([], None)
        return self.batch.sampling.sample_step(logits, inputs.batch_rows, inputs.batch_rows_host, generated, counted,
                                               inputs.num_generated_host, bitmask, masked)

    def _bitmask_rows(self, delta: StepDelta, inputs: ModelInputs) -> tuple[list[int], torch.Tensor | None]:
        """Structured outputs: the sampled positions with a grammar row and their bitmask [n, words] int32."""
        if not delta.token_bitmasks:
            return [], None
        ids = [delta.request_ids[i] for i in inputs.sample_seqs]
        masked = [j for j, rid in enumerate(ids) if rid in delta.token_bitmasks]
        if not masked:
            return [], None
        words = [torch.frombuffer(bytearray(delta.token_bitmasks[ids[j]]), dtype=torch.int32) for j in masked]
        return masked, torch.stack(words).to(self.device, non_blocking=True)

    def _execute_one(self, delta: StepDelta, inputs: ModelInputs, kv_caches: KVCaches) -> Callable[[], SampledTokens]:
        """Launch one step (prefill chunks, with decodes or not); what it returns reads the sampled tokens (the
        one host sync, so async scheduling can launch the next step first: the sampled tokens stay on the
        device as the carry of a `continues` delta)."""
        hidden = self._forward(inputs, kv_caches)                                          # [T, hidden]
        read_prompt_logprobs = self._prompt_logprobs(delta, hidden)
        if not inputs.sample_seqs:
            done = self.platform.ready_event()

            def finish_chunks() -> SampledTokens:
                if done is not None:
                    done.synchronize()
                return SampledTokens(prompt_logprobs=read_prompt_logprobs())
            return finish_chunks
        logits = self.model.compute_logits(hidden[inputs.sample_rows])                    # [N, vocab]
        if self.tp_rank != 0:
            return SampledTokens  # every rank computes the logits (the lm_head all-gathers them); rank 0 samples
        result = self._sample(logits, inputs, delta)
        ids = [delta.request_ids[i] for i in inputs.sample_seqs]
        self._carry = ({rid: j for j, rid in enumerate(ids)}, result.tokens.clamp(min=0))
        host_tokens = self.platform.host_copy(result.tokens)
        host_packed = self.platform.host_copy(result.logprobs) if result.logprobs is not None else None
        done = self.platform.ready_event()

        def finish() -> SampledTokens:
            if done is not None:
                done.synchronize()          # this step's copies only, not work launched after it
            logprobs = {}
            if host_packed is not None:
                entries = unpack_logprobs(host_packed.tolist(), result.num_logprobs)
                logprobs = {ids[j]: [entry] for j, entry in zip(result.logprob_positions, entries)}
            return _sampled_tokens({rid: [t] for rid, t in zip(ids, host_tokens.tolist())}, logprobs,
                                   read_prompt_logprobs())
        return finish

    def _prompt_logprobs(self, delta: StepDelta, hidden: torch.Tensor) -> Callable[[], dict]:
        """Launch the prompt logprobs of this step's prefill chunks, for the requests that asked (every rank
        computes the logits; rank 0 keeps them); return what reads them once the step's copies landed."""
        jobs, row = [], 0
        for request_id, n in zip(delta.request_ids, delta.num_scheduled_tokens):
            req = self.batch.requests[request_id]
            if req.num_prompt_logprobs is not None:
                first, end = prompt_logprob_positions(req.num_computed_tokens, n, req.num_prompt_tokens)
                if end > first:
                    jobs.append((request_id, row, first, end - first, req.token_ids, req.num_prompt_logprobs))
            row += n
        if not jobs:
            return dict
        return compute_prompt_logprobs(hidden, self.model.compute_logits, jobs, keep=self.tp_rank == 0,
                                       to_host=self.platform.host_copy,
                                       slice_positions=prompt_logprobs_slice(self.facts.vocab_size))

    def _execute_steps(self, delta: StepDelta, inputs: ModelInputs) -> Callable[[], SampledTokens]:
        """Launch an all-decode delta: request i runs delta.steps_of(i) decode steps, each step's sampled
        tokens feeding the next on the device; what it returns reads them (one host sync, at the end).

        A sequence past its last step keeps running with the batch (its row writes to
        PADDING_SLOT_ID and its samples are dropped).
        """
        bs = self.spec.block_size
        meta = inputs.meta
        steps = [delta.steps_of(i) for i in range(len(delta.request_ids))]
        num_steps = max(steps)
        ids, positions, seq_lens, slots = inputs.input_ids, inputs.positions, meta.seq_lens, meta.slot_mapping
        tables = meta.block_tables                                                              # [B, W]
        tokens = torch.empty((num_steps, len(steps)), dtype=torch.int64, device=self.device)     # [K, B]
        packed: list[torch.Tensor] = []     # per step: packed logprobs of the rows that asked [L, 3 + 2k]
        result = None
        remaining = torch.tensor(steps, dtype=torch.int64).to(self.device, non_blocking=True)       # [B]
        rows = torch.arange(len(steps), device=self.device)                                         # [B]
        active = None           # [B] bool: rows still within their steps (None: all of them)
        for k in range(num_steps):
            step_meta = replace(meta, slot_mapping=slots, seq_lens=seq_lens, max_seq_len=meta.max_seq_len + k,
                                seq_lens_host=[n + min(k, m - 1) for n, m in zip(meta.seq_lens_host, steps)])
            logits = self._decode_logits(ids, positions, step_meta)                             # [B, vocab]
            if self.tp_rank == 0:
                # a row past its last step still samples, but its token is dropped and not counted
                result = self._sample(logits, inputs, delta, k, active)
                tokens[k] = result.tokens
                if result.logprobs is not None:
                    packed.append(result.logprobs)
            del logits              # one step's logits alive at a time, as in the profiled step
            if k + 1 == num_steps:
                break
            active = remaining > k + 1                                                          # [B] bool
            ids = tokens[k].clamp(min=0)        # a NONFINITE_TOKEN row runs on, its request already lost
            positions = positions + active
            seq_lens = seq_lens + active.to(seq_lens.dtype)
            slots = torch.where(active, slot_mapping(tables, rows, positions, bs), PADDING_SLOT_ID)
        if self.tp_rank != 0:
            return SampledTokens
        last = tokens[remaining - 1, rows].clamp(min=0)         # [B]: each row's token of its own last step
        self._carry = ({rid: i for i, rid in enumerate(delta.request_ids)}, last)
        host_tokens = self.platform.host_copy(tokens)
        host_packed = self.platform.host_copy(torch.stack(packed)) if packed else None      # [K, L, 3 + 2k]
        done = self.platform.ready_event()

        def finish() -> SampledTokens:
            if done is not None:
                done.synchronize()          # this delta's copies only, not work launched after it
            sampled = host_tokens.t().tolist()
            logprobs = {}
            if host_packed is not None:     # the same rows ask at every step
                per_step = host_packed.tolist()
                for j, pos in enumerate(result.logprob_positions):
                    k = result.num_logprobs[j]
                    logprobs[delta.request_ids[pos]] = unpack_logprobs(
                        [per_step[s][j] for s in range(steps[pos])], [k] * steps[pos])
            return _sampled_tokens({request_id: row[:n] for request_id, row, n in zip(delta.request_ids, sampled, steps)},
                                   logprobs)
        return finish

    def _kv_scales_settled(self) -> bool:
        """False while --calculate-kv-scales waits for a batch to set the scales (such steps run eagerly)."""
        if self._kv_scales_pending:
            self._kv_scales_pending = any(scales.calculate_next for scales in self._kv_scales)
        return not self._kv_scales_pending

    def _forward(self, inputs: ModelInputs, kv_caches: KVCaches) -> torch.Tensor:
        """A step with prefill chunks -> hidden [T, hidden]: its bucket's graph where one holds it, else eagerly."""
        if (self.mixed_graphs is not None and kv_caches is self.kv_caches and self._kv_scales_settled()
                and inputs.meta.prefix_len is None):
            hidden = self.mixed_graphs.replay(inputs.input_ids, inputs.positions, inputs.meta)
            if hidden is not None:
                return hidden
        return self.model(inputs.input_ids, inputs.positions, kv_caches, inputs.meta)

    def _decode_logits(self, ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        # ids, positions: [B]; one decode token per sequence -> logits [B, vocab]
        if self.graphs is not None and self._kv_scales_settled() and ids.shape[0] <= self.graphs.buckets[-1]:
            return self.graphs.replay(ids, positions, meta.slot_mapping, meta.seq_lens, meta.block_tables,
                                      meta.prefix_len)
        return self.model.compute_logits(self.model(ids, positions, self.kv_caches, meta))


def _sampled_tokens(rows: dict[str, list[int]], logprobs: dict, prompt_logprobs: dict | None = None) -> SampledTokens:
    """The host's SampledTokens from each request's tokens as the device sampled them: a request's tokens
    (and logprobs) end before its first NONFINITE_TOKEN (those after it were sampled from its lost state)
    and it joins nonfinite_ids."""
    nonfinite = set()
    for request_id, row in rows.items():
        if NONFINITE_TOKEN in row:
            del row[row.index(NONFINITE_TOKEN):]
            nonfinite.add(request_id)
            if request_id in logprobs:
                logprobs[request_id] = logprobs[request_id][:len(row)]
    return SampledTokens(rows, logprobs, prompt_logprobs or {}, nonfinite)
