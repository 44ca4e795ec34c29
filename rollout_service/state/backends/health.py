"""Backend health: set by hand, or recorded from probe rounds (FAILURES_TO_UNHEALTHY misses in a
row mark a backend unhealthy, one good probe brings it back). Unhealthy backends get no new jobs."""

from __future__ import annotations

import redis

from rollout_service.schemas import BackendView
from rollout_service.state.backends.engines import probe_engines
from rollout_service.state.backends.layout import LUA_KEYS, not_found
from rollout_service.state.connection import scripts_of

FAILURES_TO_UNHEALTHY = 2

_SET_HEALTH = (
    LUA_KEYS
    + """
local info = key('info', ARGV[2])
if redis.call('EXISTS', info) == 0 then return -1 end
redis.call('HSET', info, 'healthy', ARGV[3], 'failures', 0)
return tonumber(ARGV[3])
"""
)

# ARGV: prefix, id, '1' probe ok | '0' probe failed, failures needed to go unhealthy.
_RECORD_PROBE = (
    LUA_KEYS
    + """
local info = key('info', ARGV[2])
if redis.call('EXISTS', info) == 0 then return -1 end
if ARGV[3] == '1' then
  redis.call('HSET', info, 'healthy', 1, 'failures', 0)
  return 1
end
if redis.call('HINCRBY', info, 'failures', 1) >= tonumber(ARGV[4]) then
  redis.call('HSET', info, 'healthy', 0)
end
return tonumber(redis.call('HGET', info, 'healthy'))
"""
)


class BackendHealth:
    def __init__(self, redis_client: redis.Redis, prefix: str) -> None:
        self.prefix = prefix
        self._set_health, self._record_probe = scripts_of(redis_client, _SET_HEALTH, _RECORD_PROBE)

    def set_health(self, backend_id: str, healthy: bool) -> None:
        if int(self._set_health(args=[self.prefix, backend_id, int(healthy)])) < 0:
            raise not_found(backend_id)

    def probe(self, backends: list[BackendView], timeout_s: float) -> dict[str, bool]:
        """Probe ``backends`` and record each answer: the health of those still registered, by id."""
        health: dict[str, bool] = {}
        for view, ok in zip(backends, probe_engines(backends, timeout_s)):
            state = int(self._record_probe(args=[self.prefix, view.id, int(ok), FAILURES_TO_UNHEALTHY]))
            if state >= 0:
                health[view.id] = bool(state)
        return health
