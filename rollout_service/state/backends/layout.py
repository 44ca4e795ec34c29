"""The backend registry's Redis layout, shared by every part of the pool and its Lua scripts.

Everything lives under ``{prefix}:backend:`` so every gateway and worker process shares one exact view:

- ``ids`` (set)               registered backend ids
- ``models`` (set)            models served by at least one backend
- ``info:{id}`` (hash)        url, kind, model, tokenizer, healthy, failures, total_assignments
- ``heap:{model}`` (zset)     backend id scored by its *live* assignments (the load heap)
- ``jobs:{id}`` (set)         job ids assigned to the backend; the score always equals its size
- ``job:{job_id}`` (string)   the job's sticky backend id
- ``version`` / ``paused``    weight-sync state; ``calls`` (hash job -> in-flight LLM calls);
  ``updated``                 new weights were loaded during this pause (resume keeps their version);
  ``engines_paused``          the engines were paused too (resumed by the probe round if the pause lapses)
- ``gates`` (zset)            run workers' call gates scored by when they close (Redis time, ms)

Scripts build key names from the prefix (standalone Redis or Sentinel; not Redis Cluster, which
kombu does not support either).
"""

from __future__ import annotations

from typing import Any

from rollout_service.errors import NotFound
from rollout_service.schemas import BackendView
from rollout_service.state.connection import as_text


def backend_key(prefix: str, *parts: str) -> str:
    return ":".join((prefix, "backend", *parts))


def lua_keys(prefix_at: int | str) -> str:
    """The key helpers of the registry's scripts, the prefix read from ARGV[prefix_at] (an index,
    or a Lua expression of one)."""
    return f"\nlocal p = ARGV[{prefix_at}] .. ':backend:'\n" + _LUA_KEYS_BODY


_LUA_KEYS_BODY = """local function key(a, b) if b then return p .. a .. ':' .. b end return p .. a end
-- one backend as a flat row: id, url, kind, model, tokenizer, healthy, total, live (false if unknown)
local function view_row(id)
  local f = redis.call('HMGET', key('info', id), 'url', 'kind', 'model', 'tokenizer', 'healthy',
                       'total_assignments')
  if not f[3] then return false end
  local live = redis.call('ZSCORE', key('heap', f[3]), id) or '0'
  return {id, f[1], f[2], f[3], f[4], f[5], f[6], live}
end
local function version() return redis.call('GET', key('version')) or '0' end
"""

LUA_KEYS = lua_keys(1)


def view_of(row: list[Any], version: Any) -> BackendView:
    """A backend as the registry's scripts answer it (every field converted here: no validation,
    as each LLM call of an episode reads one)."""
    id_, url, kind, model, tokenizer, healthy, total, live = [as_text(v) for v in row]
    return BackendView.model_construct(
        id=id_,
        url=url,
        kind=kind,
        model=model,
        tokenizer=tokenizer,
        healthy=healthy == "1",
        live_assignments=int(float(live)),
        total_assignments=int(total),
        policy_version=int(version),
    )


def not_found(backend_id: str) -> NotFound:
    return NotFound(f"no backend {backend_id!r}; GET /v1/backends lists the registered ones")
