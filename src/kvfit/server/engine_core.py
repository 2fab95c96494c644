"""EngineCore: the serving loop's decisions about one LLMEngine, whatever carries its requests.

Admission against the waiting queue (--max-waiting-requests; an n > 1 request counts as n), adds,
aborts, one step with its failure handling, and ending everything on shutdown or death. Two
transports run it: AsyncEngine (a thread of the HTTP process, used by tests and embedders) and the
engine core process of `kvfit serve` (core_process.py, over pyzmq). Neither touches the engine
otherwise, so both answer a request the same way.

Invariant: a request id is in `held` exactly while the engine holds the request, so aborting an id
frees its blocks at once and `abort_all` ends every request a client still waits on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvfit.engine.output import RequestOutput
from kvfit.errors import EngineDeadError
from kvfit.kv.spec import num_blocks_for_tokens
from kvfit.sampling_params import SamplingParams
from kvfit.server.protocol import APIError

logger = logging.getLogger("kvfit")


def queue_full_error(max_waiting_requests: int) -> APIError:
    return APIError(429, f"the server is at capacity: {max_waiting_requests} requests are already waiting "
                         "(--max-waiting-requests); retry later", "rate_limit_error", None, "rate_limit_exceeded")


def shutting_down_error() -> APIError:
    return APIError(503, "the server is shutting down; retry later", "service_unavailable",
                    None, "server_shutting_down")


def engine_dead_error(reason: str) -> APIError:
    return APIError(503, f"the engine has stopped and this server cannot serve requests until it is restarted "
                         f"({reason})", "service_unavailable", None, "engine_dead")


def step_failed_error() -> APIError:
    return APIError(500, "the engine failed while running this request; see the server log", "server_error")


def dead_reason(engine) -> str | None:
    """Why the engine's executor cannot run another step (None: it can), as its EngineDeadError says."""
    try:
        engine.check_alive()
    except EngineDeadError as exc:
        return str(exc)
    return None


def fatal_step_error(engine, exc: Exception) -> str | None:
    """Why a failed step leaves the engine unable to run another (None: the next step may work).

    The tensor-parallel executor stops every rank when a step fails, and each later step raises
    EngineDeadError: that engine is dead, not one batch.
    """
    if isinstance(exc, EngineDeadError):
        return str(exc)
    return dead_reason(engine)


@dataclass
class Room:
    """What the next step can still admit, as of the last step: batch slots and allocatable blocks.

    Requests added since take them in arrival order, as the scheduler's FIFO admits them; once one
    does not fit, it and every later one wait. Only those count against --max-waiting-requests.
    """

    num_free_slots: int
    num_free_blocks: int
    block_size: int
    blocked: bool              # a request waits ahead: nothing newer is admitted next step
    num_taken: int = 0         # requests added since the last step that the next step will run

    @classmethod
    def of(cls, stats: dict, max_num_seqs: int) -> "Room":
        return cls(max(max_num_seqs - stats["running"], 0), stats["kv_blocks_free"] + stats["kv_blocks_cached"],
                   stats["block_size"], stats["waiting"] > 0)

    def num_fitting(self, num_prompt_tokens: int, n: int) -> int:
        """How many of n samples of a prompt the next step admits (they share the prompt's blocks
        through the prefix cache, but each needs a batch slot)."""
        if self.blocked or num_blocks_for_tokens(num_prompt_tokens, self.block_size) > self.num_free_blocks:
            return 0
        return min(n, self.num_free_slots)

    def take(self, num_prompt_tokens: int, n: int = 1) -> None:
        """Record an added request: what fits runs next step, the rest (and all after it) waits."""
        fitting = self.num_fitting(num_prompt_tokens, n)
        if fitting:
            self.num_free_slots -= fitting
            self.num_free_blocks -= num_blocks_for_tokens(num_prompt_tokens, self.block_size)
            self.num_taken += fitting
        if fitting < n:
            self.blocked = True


class EngineCore:
    """Admission, adds, aborts and steps of one engine; not thread-safe (one loop owns it)."""

    def __init__(self, engine, max_waiting_requests: int):
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        scheduler = getattr(getattr(engine, "config", None), "scheduler", None)
        # requests run at once; engines without a scheduler config (stand-ins) get no free-slot credit
        self.max_num_seqs: int = scheduler.max_num_seqs if scheduler is not None else 0
        self.held: set[str] = set()
        self.dead_reason: str | None = None
        self.stats = dict(engine.stats())
        self._room = Room.of(self.stats, self.max_num_seqs)

    @property
    def max_requests_at_once(self) -> int:
        """Requests (samples) that can run or wait at once: --max-num-seqs + --max-waiting-requests."""
        return self.max_num_seqs + self.max_waiting_requests

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, max_tokens_given: bool = True,
            cache_salt: str | None = None) -> int:
        """Queue a request; its number of prompt tokens. Raises APIError (429 queue full, 400 unservable)
        or the engine's KvfitError."""
        engine, num_prompt_tokens = self.engine, len(prompt_ids)
        n = params.n if isinstance(params, SamplingParams) else 1
        if n > self.max_requests_at_once > 0:
            raise APIError(400, f"n={n} samples can never be queued here: at most --max-num-seqs + "
                                f"--max-waiting-requests = {self.max_requests_at_once} requests "
                                "run or wait at once; ask for fewer samples", "invalid_request_error", "n")
        # new requests are all "waiting" until the next step: those that will take a free batch slot
        # are not queued, so only the rest count against --max-waiting-requests (n samples count as n)
        num_queued = engine.stats()["waiting"] - self._room.num_taken
        num_waiting = n - self._room.num_fitting(num_prompt_tokens, n)
        if num_waiting and num_queued + num_waiting > self.max_waiting_requests:
            raise queue_full_error(self.max_waiting_requests)
        # the engine's admission check is the only one; its RequestError carries param and code
        engine.add_request(prompt_ids, params, request_id, strict_context=max_tokens_given, cache_salt=cache_salt)
        self._room.take(num_prompt_tokens, n)
        self.held.add(request_id)
        return num_prompt_tokens

    def abort(self, request_id: str) -> None:
        if request_id in self.held:
            self.held.discard(request_id)
            self.engine.abort(request_id)

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> tuple[list[RequestOutput], APIError | None]:
        """One engine step: the outputs of held requests, and the error every held request ended with
        when the step failed (then the outputs are empty; dead_reason is set if no step can run again)."""
        if self.check_ranks() is not None:
            return [], engine_dead_error(self.dead_reason)
        try:
            outputs = self.engine.step()
        except Exception as exc:
            # the engine cannot say which request broke the step: fail the batch, keep serving,
            # unless the executor cannot run another step (then the engine is dead)
            self.dead_reason = self.dead_reason or fatal_step_error(self.engine, exc)
            if self.dead_reason is not None:
                logger.error("an engine step failed and the engine cannot run another (%s); ending the %d active "
                             "requests", self.dead_reason, len(self.held))
                return [], engine_dead_error(self.dead_reason)
            logger.exception("an engine step failed; ending the %d active requests", len(self.held))
            return [], step_failed_error()
        held = [out for out in outputs if out.request_id in self.held]     # not aborted while the step ran
        for out in held:
            if out.finished:
                self.held.discard(out.request_id)
        return held, None

    def check_ranks(self) -> str | None:
        """The dead reason, after asking the engine whether its executor can still step (a tensor-parallel
        rank process can exit on its own)."""
        if self.dead_reason is None:
            self.dead_reason = dead_reason(self.engine)
        return self.dead_reason

    def abort_all(self) -> list[str]:
        """End every held request (a failed step, shutdown, death); their ids."""
        ids = list(self.held)
        for request_id in ids:
            self.engine.abort(request_id)
        self.held.clear()
        return ids

    def refresh(self) -> None:
        """Stats and the room for the next step's admissions, after a step or a round of commands."""
        self.stats = dict(self.engine.stats())
        self._room = Room.of(self.stats, self.max_num_seqs)
