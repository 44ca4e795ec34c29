"""A job's view of the inference pool: sticky backend, weight-sync gate, failover."""
from __future__ import annotations

import functools
import math
import time
from typing import Callable, Optional

from rollout_service.agent import EpisodeInterrupted
from rollout_service.backends import BackendPool, FirstCall
from rollout_service.errors import (BackendError, BackendTimeout, BackendUnreachable, ContextWindowExceeded,
                                    NoBackendAvailable)
from rollout_service.inference import InferenceClient, make_client
from rollout_service.schemas import BackendView, FinishReason, Sampling
from rollout_service.trajectory import TrajectoryBuilder


@functools.lru_cache(maxsize=256)
def client_for(kind: str, url: str, model: str) -> InferenceClient:
    return make_client(kind, url, model)


class PooledLLM:
    """Generates for one job: acquires its sticky backend, waits out pauses, moves off dead backends."""

    def __init__(self, pool: BackendPool, job_id: str, sampling: Sampling, call_timeout_s: float,
                 stop_reason: Callable[[], Optional[FinishReason]], deadline_at: float = math.inf,
                 max_moves: int = 3, job_key: str = "", max_policy_lag: Optional[int] = None) -> None:
        self.pool = pool
        self.job_id = job_id
        self.job_key = job_key
        self.max_policy_lag = max_policy_lag
        self.sampling = sampling
        self.call_timeout_s = call_timeout_s
        self.deadline_at = deadline_at
        self.stop_reason = stop_reason
        self.max_moves = max_moves
        self.last_backend_id: Optional[str] = None
        # BackendPool.first_call_soon's answer, if the run worker sent the first call's round trip early
        self.first_call: Optional[FirstCall] = None

    def generate(self, prompt_ids: list[int], max_new_tokens: int, record: TrajectoryBuilder) -> list[int]:
        backend = self._start_call()
        version = backend.policy_version
        # the pool may already have moved the job (its backend failed health probes or was removed)
        moved_from = self.last_backend_id if self.last_backend_id not in (None, backend.id) else None
        try:
            if self._stale(record, version):
                raise EpisodeInterrupted(FinishReason.stale)
            for _ in range(self.max_moves + 1):
                client = client_for(backend.kind, backend.url, backend.model)
                remaining_s = self.deadline_at - time.time()
                if remaining_s <= 0:
                    raise EpisodeInterrupted(FinishReason.deadline)
                try:
                    gen = client.generate(prompt_ids, self.sampling, max_new_tokens,
                                          min(self.call_timeout_s, remaining_s))
                    break
                except BackendTimeout:
                    if time.time() >= self.deadline_at:  # cut by the job's deadline, not a slow server
                        raise EpisodeInterrupted(FinishReason.deadline) from None
                    raise
                except ContextWindowExceeded:  # the server's context is full: a limit, like max_model_len
                    raise EpisodeInterrupted(FinishReason.context_length) from None
                except BackendUnreachable as exc:
                    moved_from = moved_from or backend.id
                    backend = self._move(backend, exc)
            else:
                raise NoBackendAvailable(f"job {self.job_id} lost {self.max_moves + 1} backends in one call")
        finally:
            self.pool.end_call(self.job_id)
        self.last_backend_id = backend.id
        record.add_generation(gen.token_ids, gen.logprobs, backend_id=backend.id, policy_version=version,
                              finish_reason=gen.finish_reason, latency_s=gen.latency_s,
                              moved_from=moved_from)
        return gen.token_ids

    def release(self) -> None:
        if self.first_call is not None:
            self.pool.drop_first_call(self.job_id, self.first_call)
            self.first_call = None
        self.pool.release(self.job_id)

    def _start_call(self) -> BackendView:
        """The job's backend for this call, after one round trip that also checks the cancel flag
        and the weight-sync gate (waited out here)."""
        while True:
            if time.time() >= self.deadline_at:
                raise EpisodeInterrupted(FinishReason.deadline)
            granted: BackendView | str = "later"
            if self.first_call is not None:
                answer, self.first_call = self.first_call, None
                granted, _ = answer()
            if granted == "later":
                granted = self.pool.start_call(self.job_id, self.sampling.model, self.job_key)
            if granted == "cancelled":
                raise EpisodeInterrupted(FinishReason.cancelled)
            if granted != "paused":
                return granted  # type: ignore[return-value]
            if reason := self.stop_reason():
                raise EpisodeInterrupted(reason)
            self.pool.wait_resumed(1.0, lambda: self.stop_reason() is not None)

    def _stale(self, record: TrajectoryBuilder, version: int) -> bool:
        """The policy moved on more than ``max_policy_lag`` versions since the episode's first call."""
        if self.max_policy_lag is None:
            return False
        versions = [t.policy_version for t in record.turns if t.policy_version is not None]
        return bool(versions) and version - min(versions) > self.max_policy_lag

    def _move(self, dead: BackendView, exc: BackendError) -> BackendView:
        try:
            return self.pool.move(self.job_id, dead.id)
        except NoBackendAvailable as none_left:
            raise NoBackendAvailable(f"{exc}; and no other healthy backend to move to: {none_left}") from exc
