"""The registry: which backends exist, what they serve, and their views (health and load included)."""

from __future__ import annotations

import hashlib
from typing import cast

import redis

from rollout_service.schemas import BackendSpec, BackendView
from rollout_service.state.backends.layout import LUA_KEYS, backend_key, not_found, view_of
from rollout_service.state.connection import as_text, scripts_of

_REGISTER = (
    LUA_KEYS
    + """
local id, url, kind, model, tokenizer, healthy = ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7]
local info = key('info', id)
local old_model = redis.call('HGET', info, 'model')
if old_model and old_model ~= model then
  local old_heap = key('heap', old_model)
  redis.call('ZREM', old_heap, id)
  if redis.call('ZCARD', old_heap) == 0 then redis.call('SREM', key('models'), old_model) end
end
if not old_model then redis.call('HSET', info, 'total_assignments', 0) end
redis.call('HSET', info, 'id', id, 'url', url, 'kind', kind, 'model', model,
           'tokenizer', tokenizer, 'healthy', healthy, 'failures', 0)
redis.call('ZADD', key('heap', model), redis.call('SCARD', key('jobs', id)), id)
redis.call('SADD', key('ids'), id)
redis.call('SADD', key('models'), model)
return 1
"""
)

_REMOVE = (
    LUA_KEYS
    + """
local id = ARGV[2]
local info = key('info', id)
local model = redis.call('HGET', info, 'model')
if not model then return 0 end
local jobs = key('jobs', id)
for _, job in ipairs(redis.call('SMEMBERS', jobs)) do
  local job_key = key('job', job)
  if redis.call('GET', job_key) == id then redis.call('DEL', job_key) end
end
redis.call('DEL', jobs, info)
local heap = key('heap', model)
redis.call('ZREM', heap, id)
if redis.call('ZCARD', heap) == 0 then redis.call('SREM', key('models'), model) end
redis.call('SREM', key('ids'), id)
return 1
"""
)

# {view rows of the given ids (all if none), version}
_VIEWS = (
    LUA_KEYS
    + """
local ids = {}
if #ARGV > 1 then
  for i = 2, #ARGV do ids[#ids + 1] = ARGV[i] end
else
  ids = redis.call('SMEMBERS', key('ids'))
end
local out = {}
for _, id in ipairs(ids) do
  local row = view_row(id)
  if row then out[#out + 1] = row end
end
return {out, version()}
"""
)


def backend_id_for(url: str) -> str:
    """Deterministic id of the backend at ``url`` (same url, same id, in every process)."""
    return "be-" + hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:12]


class BackendRegistry:
    """Register, remove and read the backends; a backend removed takes its jobs' assignments along
    (they move on their next acquire)."""

    def __init__(self, redis_client: redis.Redis, prefix: str) -> None:
        self.redis = redis_client
        self.prefix = prefix
        self._register, self._remove, self._views = scripts_of(redis_client, _REGISTER, _REMOVE, _VIEWS)

    def register(self, spec: BackendSpec, healthy: bool = True) -> BackendView:
        """Add (or update) the backend at ``spec.url``; ``healthy``: what its first probe said."""
        backend_id = backend_id_for(spec.url)
        self._register(
            args=[self.prefix, backend_id, spec.url, spec.kind, spec.model, spec.tokenizer or spec.model, int(healthy)]
        )
        return self.get(backend_id)

    def remove(self, backend_id: str) -> None:
        if not self._remove(args=[self.prefix, backend_id]):
            raise not_found(backend_id)

    def get(self, backend_id: str) -> BackendView:
        views = self.views([backend_id])
        if not views:
            raise not_found(backend_id)
        return views[0]

    def sorted_views(self) -> list[BackendView]:
        """Every backend, by model then url."""
        return sorted(self.views([]), key=lambda view: (view.model, view.url))

    def views(self, backend_ids: list[str]) -> list[BackendView]:
        """The views of ``backend_ids`` that are registered (every backend if none), in one script call."""
        rows, version = self._views(args=[self.prefix, *backend_ids])
        return [view_of(row, version) for row in rows]

    def models(self) -> list[str]:
        members = cast("set[bytes]", self.redis.smembers(backend_key(self.prefix, "models")))
        return sorted(as_text(model) for model in members)
