"""The inference-backend pool, kept in Redis and shared by every gateway and worker process.

One job per module: ``layout`` (keys and the view row every script shares), ``registry``
(register, remove, views), ``assignment`` (the load heap, sticky assignment, the call that makes
it), ``health`` (probe results, marking), ``weight_sync`` (pause, resume, policy version),
``calls`` (LLM calls in flight), ``gates`` (run workers' call gates), ``engines`` (HTTP to the
engines: probes, pause, resume, weight reloads) and ``pool`` (``BackendPool``, all of them behind
one object).
"""

from rollout_service.state.backends.assignment import AllBackendsDown, FirstCall
from rollout_service.state.backends.engines import PAUSE_MODES, answers_health, control_engines
from rollout_service.state.backends.health import FAILURES_TO_UNHEALTHY
from rollout_service.state.backends.pool import BackendPool
from rollout_service.state.backends.registry import backend_id_for

__all__ = [
    "FAILURES_TO_UNHEALTHY",
    "PAUSE_MODES",
    "AllBackendsDown",
    "BackendPool",
    "FirstCall",
    "answers_health",
    "backend_id_for",
    "control_engines",
]
