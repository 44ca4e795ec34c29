"""BackendPool: the backend parts over one Redis client and prefix, behind the calls their users make.

Each operation is one part's (registry, assignments, health, weight sync, in-flight calls, call
gates); the pool adds only those that span two parts: a probe round, moving a job off a dead
backend and undoing an unused first call.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterable

import redis

from rollout_service.errors import NotFound
from rollout_service.schemas import BackendSpec, BackendView
from rollout_service.state.backends.assignment import Assignments, FirstCall
from rollout_service.state.backends.calls import InflightCalls
from rollout_service.state.backends.engines import ENGINE_RESUME_TIMEOUT_S, control_engines
from rollout_service.state.backends.gates import CallGates
from rollout_service.state.backends.health import BackendHealth
from rollout_service.state.backends.registry import BackendRegistry
from rollout_service.state.backends.weight_sync import WeightSync
from rollout_service.state.store import BeginCall, EndCall


class BackendPool:
    """Registry + live-load heap of inference servers, shared by all processes through Redis."""

    def __init__(self, redis_client: redis.Redis, prefix: str = "rollout") -> None:
        self.redis = redis_client
        self.prefix = prefix
        self.registry = BackendRegistry(redis_client, prefix)
        self.assignments = Assignments(redis_client, prefix)
        self.health = BackendHealth(redis_client, prefix)
        self.weight_sync = WeightSync(redis_client, prefix)
        self.calls = InflightCalls(redis_client, prefix)
        self.gates = CallGates(redis_client, prefix)

    # spanning parts

    def probe(self, timeout_s: float = 2.0) -> dict[str, bool]:
        """GET {url}/health on every backend; FAILURES_TO_UNHEALTHY misses in a row mark it unhealthy.
        Engines a pause stopped are resumed here once that pause lapsed (a trainer died mid-sync)."""
        backends = self.registry.views([])
        if self.weight_sync.take_lapsed_engine_pause():
            control_engines(backends, "resume", ENGINE_RESUME_TIMEOUT_S)
        return self.health.probe(backends, timeout_s)

    def move(self, job_id: str, dead_backend_id: str, model: str | None = None) -> BackendView:
        """Move a job off a backend that failed mid-episode (it loses its prefix cache only).

        A job already moved by a concurrent caller keeps its new backend.
        """
        try:
            self.health.set_health(dead_backend_id, False)
        except NotFound:
            pass  # removed meanwhile: acquire moves the job anyway
        return self.assignments.acquire(job_id, model)

    def drop_first_call(self, job_id: str, answer: FirstCall) -> None:
        """A first call granted by ``first_call_soon`` that will not be made: end it, and release
        the assignment it made (one it found belongs to whoever holds the job)."""
        try:
            granted, assigned = answer()
        except Exception:  # it failed: nothing was counted
            return
        if isinstance(granted, BackendView):
            self.calls.end_call(job_id)
            if assigned:
                self.assignments.release(job_id)

    # registry

    def register(self, spec: BackendSpec, healthy: bool = True) -> BackendView:
        return self.registry.register(spec, healthy)

    def remove(self, backend_id: str) -> None:
        self.registry.remove(backend_id)

    def get(self, backend_id: str) -> BackendView:
        return self.registry.get(backend_id)

    def list(self) -> builtins.list[BackendView]:
        return self.registry.sorted_views()

    def models(self) -> builtins.list[str]:
        return self.registry.models()

    # assignments

    def backend_of(self, job_id: str) -> str | None:
        return self.assignments.backend_of(job_id)

    def acquire(self, job_id: str, model: str | None) -> BackendView:
        return self.assignments.acquire(job_id, model)

    def start_call(self, job_id: str, model: str | None, job_key: str) -> BackendView | str:
        return self.assignments.start_call(job_id, model, job_key)

    def first_call_soon(self, job_id: str, job_key: str) -> FirstCall:
        return self.assignments.first_call_soon(job_id, job_key)

    def first_call_with_begin(self, job_id: str, answers: builtins.list[FirstCall]) -> BeginCall:
        return self.assignments.first_call_with_begin(job_id, answers)

    def release(self, job_id: str) -> None:
        self.assignments.release(job_id)

    def release_with_end(self, job_id: str) -> EndCall:
        return self.assignments.release_with_end(job_id)

    def reconcile(self, live_job_ids: Iterable[str]) -> int:
        return self.assignments.reconcile(live_job_ids)

    # health

    def set_health(self, backend_id: str, healthy: bool) -> None:
        self.health.set_health(backend_id, healthy)

    # weight sync

    def pause(self, ttl_s: float) -> None:
        self.weight_sync.pause(ttl_s)

    def engines_paused(self, paused: bool) -> None:
        self.weight_sync.engines_paused(paused)

    def pause_expires_in_s(self) -> float | None:
        return self.weight_sync.pause_expires_in_s()

    def paused(self) -> bool:
        return self.weight_sync.paused()

    def resume(self, policy_version: int | None = None, lift: bool = True) -> int:
        return self.weight_sync.resume(policy_version, lift)

    def weights_loaded(self, policy_version: int | None = None) -> int:
        return self.weight_sync.weights_loaded(policy_version)

    def policy_version(self) -> int:
        return self.weight_sync.policy_version()

    def check_version(self, policy_version: int | None) -> None:
        self.weight_sync.check_version(policy_version)

    def wait_resumed(self, timeout_s: float, should_stop: Callable[[], bool]) -> bool:
        return self.weight_sync.wait_resumed(timeout_s, should_stop)

    # calls in flight

    def begin_call(self, job_id: str) -> int | None:
        return self.calls.begin_call(job_id)

    def end_call(self, job_id: str) -> Callable[[], int | None]:
        return self.calls.end_call(job_id)

    def end_counted_call(self, job_id: str) -> Callable[[], int | None]:
        return self.calls.end_counted_call(job_id)

    def version_soon(self) -> Callable[[], int | None]:
        return self.calls.version_soon()

    def check_call_soon(self, job_id: str, job_key: str) -> Callable[[], tuple[str, str]]:
        return self.calls.check_call_soon(job_id, job_key)

    def inflight_calls(self) -> int:
        return self.calls.inflight_calls()

    # call gates

    def renew_gate(self, owner: str, lease_s: float) -> int | None:
        return self.gates.renew_gate(owner, lease_s)

    def renew_busy_gate(self, owner: str, lease_s: float, busy: bool) -> tuple[int | None, bool]:
        return self.gates.renew_busy_gate(owner, lease_s, busy)

    def release_gate(self, owner: str) -> None:
        self.gates.release_gate(owner)

    def release_gate_soon(self, owner: str) -> None:
        self.gates.release_gate_soon(owner)

    def open_gates(self) -> int:
        return self.gates.open_gates()
