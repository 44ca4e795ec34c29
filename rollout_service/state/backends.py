"""The inference-backend pool: registry, live-load heap, sticky assignment, health, weight sync.

Everything lives in Redis under ``{prefix}:backend:`` so every gateway and worker process
shares one exact view:

- ``ids`` (set)               registered backend ids
- ``models`` (set)            models served by at least one backend
- ``info:{id}`` (hash)        url, kind, model, tokenizer, healthy, failures, total_assignments
- ``heap:{model}`` (zset)     backend id scored by its *live* assignments (the load heap)
- ``jobs:{id}`` (set)         job ids assigned to the backend; the score always equals its size
- ``job:{job_id}`` (string)   the job's sticky backend id
- ``version`` / ``paused``    weight-sync state; ``calls`` (hash job -> in-flight LLM calls);
  ``updated``                 new weights were loaded during this pause (resume keeps their version);
  ``engines_paused``          the engines were paused too (resumed by the probe round if the pause lapses)

Every mutation of the assignment state is one Lua script, so counts stay exact with any
number of concurrent workers and a crash can never lose or double-count an assignment.
Scripts build key names from the prefix (standalone Redis or Sentinel; not Redis Cluster,
which kombu does not support either).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import redis

from rollout_service.concurrency.autopipeline import fire, submit, submit_commands
from rollout_service.errors import NoBackendAvailable, NotFound, ValidationError
from rollout_service.schemas import BackendSpec, BackendView, EngineResult
from rollout_service.state.store import BEGIN_STAGE_ARGS, BEGIN_STAGE_FUNCTION, BeginCall, as_text, scripts_of

FAILURES_TO_UNHEALTHY = 2


class AllBackendsDown(NoBackendAvailable):
    """Every backend of the model is unhealthy (its engines may be restarting): worth waiting for."""


FirstCall = Callable[[], tuple[BackendView | str, bool]]  # BackendPool.first_call_soon's answer
PROBE_THREADS = 32


def _lua_keys(prefix_at: int) -> str:
    """The key helpers of the registry's scripts, the prefix read from ARGV[prefix_at]."""
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
_LUA_KEYS = _lua_keys(1)

_REGISTER = (
    _LUA_KEYS
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
    _LUA_KEYS
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

# acquire(job, model) -> {'ok', view row, version, '1' if the job held no backend before} or an error
# tuple the client turns into an exception.
_ACQUIRE_FUNCTION = """
local function acquire(job, model)
  local job_key = key('job', job)
  local current = redis.call('GET', job_key)
  local current_model = false
  if current then
    local f = redis.call('HMGET', key('info', current), 'url', 'kind', 'model', 'tokenizer', 'healthy',
                         'total_assignments')
    current_model = f[3]
    if current_model and f[5] == '1' and (model == '' or model == current_model) then
      local live = redis.call('ZSCORE', key('heap', current_model), current) or '0'
      return {'ok', {current, f[1], f[2], f[3], f[4], f[5], f[6], live}, version(), '0'}
    end
  end
  if model == '' then model = current_model or '' end
  if model == '' then
    local models = redis.call('SMEMBERS', key('models'))
    if #models == 0 then return {'no_models'} end
    if #models > 1 then return {'ambiguous', unpack(models)} end
    model = models[1]
  elseif redis.call('SISMEMBER', key('models'), model) == 0 then
    return {'unknown_model', model, unpack(redis.call('SMEMBERS', key('models')))}
  end
  if current then
    redis.call('DEL', job_key)
    if redis.call('SREM', key('jobs', current), job) == 1 and current_model then
      redis.call('ZINCRBY', key('heap', current_model), -1, current)
    end
  end
  local heap = key('heap', model)
  local members = redis.call('ZRANGE', heap, 0, -1)
  for _, id in ipairs(members) do
    local info = key('info', id)
    local f = redis.call('HMGET', info, 'healthy', 'url', 'kind', 'tokenizer')
    if f[1] == '1' then
      local live = redis.call('ZINCRBY', heap, 1, id)
      local total = redis.call('HINCRBY', info, 'total_assignments', 1)
      redis.call('SADD', key('jobs', id), job)
      redis.call('SET', job_key, id)
      return {'ok', {id, f[2], f[3], model, f[4], '1', total, live}, version(), current and '0' or '1'}
    end
  end
  local urls = {}
  for _, id in ipairs(members) do urls[#urls + 1] = redis.call('HGET', key('info', id), 'url') end
  return {'none_healthy', model, unpack(urls)}
end
"""
_LUA_ACQUIRE = _LUA_KEYS + _ACQUIRE_FUNCTION

_ACQUIRE = _LUA_ACQUIRE + "return acquire(ARGV[2], ARGV[3])"

# The one round trip before an LLM call. ARGV: prefix, job, model, the job's hash (its cancel flag),
# '1' for a first call sent before the job's stage began: its model is the one init recorded for an
# episode that calls the LLM first ('later' if it recorded none). An 'ok' answer's 4th element is '1'
# when this call made the job's assignment.
_START_CALL = (
    _LUA_ACQUIRE
    + """
local job = redis.call('HMGET', ARGV[4], 'cancel_requested', 'first_call_model')
if job[1] == '1' then return {'cancelled'} end
local model = ARGV[3]
if ARGV[5] == '1' then
  model = job[2]
  if not model then return {'later'} end
end
if redis.call('EXISTS', key('paused')) == 1 then return {'paused'} end
local answer = acquire(ARGV[2], model)
if answer[1] == 'ok' then redis.call('HINCRBY', key('calls'), ARGV[2], 1) end
return answer
"""
)

# The run stage's begin (store.BEGIN_STAGE_FUNCTION) and, once begun, its first LLM call (as
# _START_CALL's for a first call), in one script: ARGV after the begin's: prefix, job. Answers
# {the begin's answer, the first call's ('later' if init recorded no model) or false}.
_BEGIN_RUN = (
    BEGIN_STAGE_FUNCTION
    + _lua_keys(BEGIN_STAGE_ARGS + 1)
    + _ACQUIRE_FUNCTION
    + """
local begun = begin_stage()
if begun[1] ~= 'ok' then return {begun, false} end
local job = ARGV[BEGIN_STAGE_ARGS + 2]
local model = redis.call('HGET', KEYS[1], 'first_call_model')
if not model then return {begun, {'later'}} end
if redis.call('EXISTS', key('paused')) == 1 then return {begun, {'paused'}} end
local answer = acquire(job, model)
if answer[1] == 'ok' then redis.call('HINCRBY', key('calls'), job, 1) end
return {begun, answer}
""".replace("BEGIN_STAGE_ARGS", str(BEGIN_STAGE_ARGS))
)

_RELEASE = (
    _LUA_KEYS
    + """
local job = ARGV[2]
local job_key = key('job', job)
local id = redis.call('GET', job_key)
if not id then return false end
redis.call('DEL', job_key)
if redis.call('SREM', key('jobs', id), job) == 1 then
  local model = redis.call('HGET', key('info', id), 'model')
  if model then redis.call('ZINCRBY', key('heap', model), -1, id) end
end
if tonumber(redis.call('HGET', key('calls'), job) or '1') <= 0 then redis.call('HDEL', key('calls'), job) end
return id
"""
)

_SET_HEALTH = (
    _LUA_KEYS
    + """
local info = key('info', ARGV[2])
if redis.call('EXISTS', info) == 0 then return -1 end
redis.call('HSET', info, 'healthy', ARGV[3], 'failures', 0)
return tonumber(ARGV[3])
"""
)

# ARGV: prefix, id, '1' probe ok | '0' probe failed, failures needed to go unhealthy.
_RECORD_PROBE = (
    _LUA_KEYS
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

_RECONCILE = (
    _LUA_KEYS
    + """
local live = {}
for i = 2, #ARGV do live[ARGV[i]] = true end
local dropped = 0
for _, id in ipairs(redis.call('SMEMBERS', key('ids'))) do
  local jobs = key('jobs', id)
  for _, job in ipairs(redis.call('SMEMBERS', jobs)) do
    local job_key = key('job', job)
    local owner = redis.call('GET', job_key)
    if not live[job] or owner ~= id then
      redis.call('SREM', jobs, job)
      if owner == id then redis.call('DEL', job_key) end
      dropped = dropped + 1
    end
  end
  local model = redis.call('HGET', key('info', id), 'model')
  if model then redis.call('ZADD', key('heap', model), redis.call('SCARD', jobs), id) end
end
for _, model in ipairs(redis.call('SMEMBERS', key('models'))) do
  local heap = key('heap', model)
  for _, id in ipairs(redis.call('ZRANGE', heap, 0, -1)) do
    if redis.call('EXISTS', key('info', id)) == 0 then redis.call('ZREM', heap, id) end
  end
  if redis.call('ZCARD', heap) == 0 then redis.call('SREM', key('models'), model) end
end
local calls = key('calls')
for _, job in ipairs(redis.call('HKEYS', calls)) do
  if not live[job] then redis.call('HDEL', calls, job) end
end
return dropped
"""
)

# {view rows of the given ids (all if none), version}
_VIEWS = (
    _LUA_KEYS
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

# ARGV: prefix, version ('' : current + 1, or current if new weights were loaded during the pause),
# '1' to lift the pause as well ('0': only move the version, the engines resume first).
_RESUME = (
    _LUA_KEYS
    + """
local current = tonumber(redis.call('GET', key('version')) or '0')
local version = current + 1
if ARGV[2] ~= '' then version = tonumber(ARGV[2])
elseif redis.call('EXISTS', key('updated')) == 1 then version = current end
if version < current then return {0, current} end
redis.call('SET', key('version'), version)
redis.call('DEL', key('updated'))
if ARGV[3] ~= '0' then
  redis.call('DEL', key('paused'))
  redis.call('PUBLISH', key('resumed'), version)
end
return {1, version}
"""
)

# New weights are in the engines: ARGV: prefix, their version ('' : current + 1).
_WEIGHTS_LOADED = (
    _LUA_KEYS
    + """
local current = tonumber(redis.call('GET', key('version')) or '0')
local version = current + 1
if ARGV[2] ~= '' then version = tonumber(ARGV[2]) end
if version < current then return {0, current} end
redis.call('SET', key('version'), version)
local pause_ms = redis.call('PTTL', key('paused'))
if pause_ms > 0 then redis.call('SET', key('updated'), 1, 'PX', pause_ms) end
return {1, version}
"""
)

_BEGIN_CALL = (
    _LUA_KEYS
    + """
if redis.call('EXISTS', key('paused')) == 1 then return false end
redis.call('HINCRBY', key('calls'), ARGV[2], 1)
return tonumber(redis.call('GET', key('version')) or '0')
"""
)

# KEYS: the in-flight calls hash, the version key. ARGV: job.
_END_CALL = """
if redis.call('HINCRBY', KEYS[1], ARGV[1], -1) <= 0 then redis.call('HDEL', KEYS[1], ARGV[1]) end
return redis.call('GET', KEYS[2]) or '0'
"""


# The service's pause lapsed (its ttl) while the engines it paused are still paused: '1' for the one
# caller that resumes them.
_LAPSED = (
    _LUA_KEYS
    + """
if redis.call('EXISTS', key('paused')) == 1 then return 0 end
return redis.call('DEL', key('engines_paused'))
"""
)


# A run worker's call gate (llm.CallGate): its lease to start calls without a round trip each, a
# member of key('gates') scored by when it closes (Redis time, ms).
_LUA_GATES = (
    _LUA_KEYS
    + """
local function now_ms() local t = redis.call('TIME') return t[1] * 1000 + math.floor(t[2] / 1000) end
"""
)

# ARGV: prefix, owner, lease ms, '1' while calls started under the gate are in flight. Refused while
# paused (a gate still open and busy stays open, its calls counted by the pause until they end); else
# open until now + lease. The last element: 1 if the gate had not lapsed (held since its last renewal).
_RENEW_GATE = (
    _LUA_GATES
    + """
local gates, now = key('gates'), now_ms()
local open_until = redis.call('ZSCORE', gates, ARGV[2])
local held = (open_until and tonumber(open_until) > now) and 1 or 0
if redis.call('EXISTS', key('paused')) == 1 then
  if held == 1 and ARGV[4] == '1' then redis.call('ZADD', gates, now + tonumber(ARGV[3]), ARGV[2]) end
  return {'paused', held}
end
redis.call('ZADD', gates, now + tonumber(ARGV[3]), ARGV[2])
return {'ok', version(), held}
"""
)

_RELEASE_GATE = _LUA_GATES + "return redis.call('ZREM', key('gates'), ARGV[2])"

_OPEN_GATES = (
    _LUA_GATES
    + """
redis.call('ZREMRANGEBYSCORE', key('gates'), '-inf', now_ms())
return redis.call('ZCARD', key('gates'))
"""
)


def backend_id_for(url: str) -> str:
    """Deterministic id of the backend at ``url`` (same url, same id, in every process)."""
    return "be-" + hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:12]


class BackendPool:
    """Registry + live-load heap of inference servers, shared by all processes through Redis."""

    def __init__(self, redis_client: redis.Redis, prefix: str = "rollout") -> None:
        self.redis = redis_client
        self.prefix = prefix
        (
            self._register,
            self._remove,
            self._acquire,
            self._start_call,
            self._release,
            self._set_health,
            self._record_probe,
            self._reconcile,
            self._views,
            self._resume,
            self._begin_call,
            self._end_call,
            self._renew_gate,
            self._release_gate,
            self._open_gates,
            self._weights_loaded,
        ) = scripts_of(
            redis_client,
            _REGISTER,
            _REMOVE,
            _ACQUIRE,
            _START_CALL,
            _RELEASE,
            _SET_HEALTH,
            _RECORD_PROBE,
            _RECONCILE,
            _VIEWS,
            _RESUME,
            _BEGIN_CALL,
            _END_CALL,
            _RENEW_GATE,
            _RELEASE_GATE,
            _OPEN_GATES,
            _WEIGHTS_LOADED,
        )
        self._lapsed, self._begin_run = scripts_of(redis_client, _LAPSED, _BEGIN_RUN)

    def _key(self, *parts: str) -> str:
        return ":".join((self.prefix, "backend", *parts))

    # registry

    def register(self, spec: BackendSpec, healthy: bool = True) -> BackendView:
        """Add (or update) the backend at ``spec.url``; ``healthy``: what its first probe said."""
        backend_id = backend_id_for(spec.url)
        self._register(
            args=[self.prefix, backend_id, spec.url, spec.kind, spec.model, spec.tokenizer or spec.model, int(healthy)]
        )
        return self.get(backend_id)

    def remove(self, backend_id: str) -> None:
        if not self._remove(args=[self.prefix, backend_id]):
            raise self._not_found(backend_id)

    def get(self, backend_id: str) -> BackendView:
        views = self._read_views([backend_id])
        if not views:
            raise self._not_found(backend_id)
        return views[0]

    def list(self) -> list[BackendView]:
        return sorted(self._read_views([]), key=lambda view: (view.model, view.url))

    def models(self) -> list[str]:
        return sorted(as_text(model) for model in self.redis.smembers(self._key("models")))

    def backend_of(self, job_id: str) -> str | None:
        """The job's sticky backend id, if it holds one."""
        value = self.redis.get(self._key("job", job_id))
        return None if value is None else as_text(value)

    # assignment

    def acquire(self, job_id: str, model: str | None) -> BackendView:
        """The job's backend: its sticky one while registered, healthy and serving ``model``;
        else the least-loaded healthy backend of the model's pool (``model`` None: the only
        model, or the model of the job's previous backend). Cheap enough to call before every
        LLM call, which is how a job follows a removal or a failed health probe."""
        return self._granted(self._acquire(args=[self.prefix, job_id, model or ""]))

    def start_call(self, job_id: str, model: str | None, job_key: str) -> BackendView | str:
        """Everything before an LLM call in one round trip: ``"cancelled"`` if the job hash at
        ``job_key`` has its cancel flag up, ``"paused"`` during a weight sync, else the job's
        backend (as ``acquire``) with the call counted in flight (``end_call`` ends it)."""
        reply = self._start_call(args=[self.prefix, job_id, model or "", job_key])
        status = as_text(reply[0])
        return status if status in ("cancelled", "paused") else self._granted(reply)

    def first_call_soon(self, job_id: str, job_key: str) -> FirstCall:
        """``start_call`` for a job's first LLM call, sent now and answered when the result is
        called: a green run worker sends it with the stage's begin, in one round trip. Only for a
        job whose episode calls the LLM first (init records its model; no sandbox or harness to
        start before, which would hold a counted call while a trainer waits to sync weights);
        ``"later"`` for the others. The answer also says whether this call made the job's
        assignment (``drop_first_call`` undoes an unused one)."""
        return self._first_call_answer(
            submit(self.redis, self._start_call, args=[self.prefix, job_id, "", job_key, "1"])
        )

    def _first_call_answer(self, pending: Callable[[], Any]) -> FirstCall:
        replies: list[Any] = []  # read once: prepare and the first call both ask

        def answer() -> tuple[BackendView | str, bool]:
            if not replies:
                replies.append(pending())
            reply = replies[0]
            status = as_text(reply[0])
            if status in ("cancelled", "paused", "later"):
                return status, False
            if len(replies) == 1:
                replies.append((self._granted(reply), as_text(reply[3]) == "1"))
            return replies[1]

        return answer

    def first_call_with_begin(self, job_id: str, answers: list[FirstCall]) -> BeginCall:
        """``first_call_soon`` made by the script that begins the job's run stage
        (``JobStore.begin_stages(calls=...)``): one script call for both, and none for a job whose
        stage does not begin. Its answer is appended to ``answers``."""

        def answered(reply: Any) -> None:
            if reply is not None:
                answers.append(self._first_call_answer(lambda: reply))

        return BeginCall(self._begin_run, [self.prefix, job_id], answered)

    def drop_first_call(self, job_id: str, answer: FirstCall) -> None:
        """A first call granted by ``first_call_soon`` that will not be made: end it, and release
        the assignment it made (one it found belongs to whoever holds the job)."""
        try:
            granted, assigned = answer()
        except Exception:  # it failed: nothing was counted
            return
        if isinstance(granted, BackendView):
            self.end_call(job_id)
            if assigned:
                self.release(job_id)

    def _granted(self, reply: list[Any]) -> BackendView:
        status = as_text(reply[0])
        if status == "ok":
            return _view(reply[1], reply[2])
        rest = [as_text(part) for part in reply[1:]]
        if status == "no_models":
            raise NoBackendAvailable(
                "no inference backend is registered; register one with POST /v1/backends "
                '{"url": ..., "kind": "vllm" | "sglang" | "reference", "model": ...}'
            )
        if status == "ambiguous":
            raise ValidationError(
                f"several models are served ({', '.join(sorted(rest))}); set sampling.model "
                "to the one this job should use"
            )
        if status == "unknown_model":
            served = ", ".join(sorted(rest[1:])) or "none"
            raise ValidationError(
                f"no backend serves model {rest[0]!r}; served models: {served}. Set "
                "sampling.model to one of them or register a backend for it (POST /v1/backends)"
            )
        model_name, urls = rest[0], rest[1:]
        raise AllBackendsDown(
            f"no healthy backend for model {model_name!r}: all {len(urls)} registered "
            f"({', '.join(urls)}) failed their /health probes or calls; start or fix them "
            "(they come back on the next good probe), or register a healthy one with "
            "POST /v1/backends"
        )

    def release(self, job_id: str) -> None:
        """The job is done with its backend (a green worker does not wait: its client's next
        call, e.g. the end of the stage, is sent after this one)."""
        fire(self.redis, self._release, args=[self.prefix, job_id])

    def move(self, job_id: str, dead_backend_id: str, model: str | None = None) -> BackendView:
        """Move a job off a backend that failed mid-episode (it loses its prefix cache only).

        A job already moved by a concurrent caller keeps its new backend.
        """
        try:
            self.set_health(dead_backend_id, False)
        except NotFound:
            pass  # removed meanwhile: acquire moves the job anyway
        return self.acquire(job_id, model)

    def reconcile(self, live_job_ids: Iterable[str]) -> int:
        """Drop assignments of jobs that are not live (leaked by dead workers); recompute every score."""
        return int(self._reconcile(args=[self.prefix, *live_job_ids]))

    # health

    def set_health(self, backend_id: str, healthy: bool) -> None:
        if int(self._set_health(args=[self.prefix, backend_id, int(healthy)])) < 0:
            raise self._not_found(backend_id)

    def probe(self, timeout_s: float = 2.0) -> dict[str, bool]:
        """GET {url}/health on every backend; FAILURES_TO_UNHEALTHY misses in a row mark it unhealthy.
        Engines a pause stopped are resumed here once that pause lapsed (a trainer died mid-sync)."""
        backends = self._read_views([])
        if int(self._lapsed(args=[self.prefix])):
            control_engines(backends, "resume", ENGINE_RESUME_TIMEOUT_S)
        if not backends:
            return {}
        client = _health_client()
        with ThreadPoolExecutor(min(PROBE_THREADS, len(backends))) as pool:
            answers = list(pool.map(lambda view: _answers_health(client, view.url, timeout_s), backends))
        health = {}
        for view, ok in zip(backends, answers):
            state = int(self._record_probe(args=[self.prefix, view.id, int(ok), FAILURES_TO_UNHEALTHY]))
            if state >= 0:
                health[view.id] = bool(state)
        return health

    # weight sync

    def pause(self, ttl_s: float) -> None:
        """Stop new LLM calls for ``ttl_s`` seconds, or until resume(); pausing again renews it
        (a trainer that dies mid-sync must not leave the service paused for good)."""
        self.redis.set(self._key("paused"), 1, px=max(int(ttl_s * 1000), 1))

    def engines_paused(self, paused: bool) -> None:
        """Whether the engines are paused as well (``probe`` resumes them if the pause lapses)."""
        if paused:
            self.redis.set(self._key("engines_paused"), 1)
        else:
            self.redis.delete(self._key("engines_paused"))

    def pause_expires_in_s(self) -> float | None:
        ttl_ms = self.redis.pttl(self._key("paused"))
        return ttl_ms / 1000 if ttl_ms >= 0 else None

    def resume(self, policy_version: int | None = None, lift: bool = True) -> int:
        """Move to ``policy_version`` (None: one up, or the version of weights loaded during this
        pause) and lift the pause; ``lift=False`` moves the version only (calls a keep-mode pause
        froze in the engines then end under it)."""
        requested = "" if policy_version is None else str(int(policy_version))
        return self._versioned(self._resume(args=[self.prefix, requested, "1" if lift else "0"]), policy_version)

    def weights_loaded(self, policy_version: int | None = None) -> int:
        """Every engine of a pool now serves new weights: the policy version moves to
        ``policy_version`` (None: one up) at once; during a pause, resume keeps it."""
        requested = "" if policy_version is None else str(int(policy_version))
        return self._versioned(self._weights_loaded(args=[self.prefix, requested]), policy_version)

    def check_version(self, policy_version: int | None) -> None:
        """A ValidationError if ``policy_version`` is below the current one (versions only go up)."""
        if policy_version is not None and policy_version < self.policy_version():
            self._versioned([0, self.policy_version()], policy_version)

    @staticmethod
    def _versioned(reply: list[Any], policy_version: int | None) -> int:
        accepted, version = reply
        if not int(accepted):
            raise ValidationError(
                f"policy_version {policy_version} is below the current {int(version)}; versions "
                "only go up: pass a version >= the current one, or omit it to bump by one"
            )
        return int(version)

    def policy_version(self) -> int:
        return int(self.redis.get(self._key("version")) or 0)

    def paused(self) -> bool:
        return bool(self.redis.exists(self._key("paused")))

    def begin_call(self, job_id: str) -> int | None:
        """Start an LLM call: None while paused, else the policy version the call runs under."""
        version = self._begin_call(args=[self.prefix, job_id])
        return None if version is None else int(version)

    def end_call(self, job_id: str) -> Callable[[], int | None]:
        """The call is over. Its answer, the policy version when it ended, rides the next shared
        round trip: read it later (``TrajectoryBuilder`` does when the turn is settled), never wait.
        Harmless for a call that was not counted (its job's count never goes below 0)."""
        pending = submit(self.redis, self._end_call, keys=[self._key("calls"), self._key("version")], args=[job_id])

        def version() -> int | None:
            try:
                return int(as_text(pending()))
            except Exception:  # a Redis blip: the turn records its start version only
                return None

        return version

    def end_counted_call(self, job_id: str) -> Callable[[], int | None]:
        """``end_call`` for a call its start's answer says was counted, in two plain commands (its
        job's count stays at 0 until ``release``)."""
        pending = submit_commands(
            self.redis, [("HINCRBY", self._key("calls"), job_id, -1), ("GET", self._key("version"))]
        )
        return self._version_of(pending, 1)

    def version_soon(self) -> Callable[[], int | None]:
        """The policy version now, read with the next shared round trip (the end of a call its
        worker's gate carried, not counted here)."""
        return self._version_of(submit_commands(self.redis, [("GET", self._key("version"))]), 0)

    @staticmethod
    def _version_of(pending: Callable[[], list[Any]], at: int) -> Callable[[], int | None]:
        def version() -> int | None:
            try:
                return int(as_text(pending()[at] or 0))
            except Exception:  # a Redis blip: the turn records its start version only
                return None

        return version

    def renew_gate(self, owner: str, lease_s: float) -> int | None:
        """Keep ``owner``'s call gate open for ``lease_s`` more: the policy version, or None while paused."""
        return self.renew_busy_gate(owner, lease_s, False)[0]

    def renew_busy_gate(self, owner: str, lease_s: float, busy: bool) -> tuple[int | None, bool]:
        """``renew_gate`` for a worker whose calls started under the gate are in flight (``busy``):
        refused while paused, the gate is kept open for them if it has not lapsed. Also whether
        the gate had not lapsed since the last renewal (its calls were counted all along)."""
        reply = self._renew_gate(args=[self.prefix, owner, max(int(lease_s * 1000), 1), "1" if busy else "0"])
        if as_text(reply[0]) == "ok":
            return int(as_text(reply[1])), as_text(reply[2]) == "1"
        return None, as_text(reply[1]) == "1"

    def release_gate(self, owner: str) -> None:
        self._release_gate(args=[self.prefix, owner])

    def release_gate_soon(self, owner: str) -> None:
        """``release_gate`` with the next shared round trip, not waited for."""
        submit_commands(self.redis, [("ZREM", self._key("gates"), owner)])

    def open_gates(self) -> int:
        """Run workers that may still start calls without asking, or whose calls started under
        their gate are still in flight (a pause waits for them too)."""
        return int(self._open_gates(args=[self.prefix]))

    def check_call_soon(self, job_id: str, job_key: str) -> Callable[[], tuple[str, str]]:
        """What a call started under its worker's gate checks once it has ended (the gate counts the
        call): ``("ok" | "cancelled", backend the job is assigned to)``, read when first asked for,
        so it rides the shared round trip of the call's end (``version_soon``) instead of one of its own."""
        sent: list[Callable[[], list[Any]]] = []

        def answer() -> tuple[str, str]:
            if not sent:
                sent.append(
                    submit_commands(
                        self.redis, [("HGET", job_key, "cancel_requested"), ("GET", self._key("job", job_id))]
                    )
                )
            replies = sent[0]()
            if errors := [reply for reply in replies if isinstance(reply, Exception)]:
                raise errors[0]
            cancel, assigned = replies
            return "cancelled" if as_text(cancel or b"") == "1" else "ok", as_text(assigned or b"")

        return answer

    def inflight_calls(self) -> int:
        return sum(int(count) for count in self.redis.hvals(self._key("calls")))

    def wait_resumed(self, timeout_s: float, should_stop: Callable[[], bool]) -> bool:
        """Block until not paused (True), or until timeout / should_stop() (False)."""
        if not self.paused():
            return True
        deadline = time.monotonic() + timeout_s
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.subscribe(self._key("resumed"))
            while self.paused():  # checked after subscribing, so no resume is missed
                remaining = deadline - time.monotonic()
                if remaining <= 0 or should_stop():
                    return False
                pubsub.get_message(timeout=min(0.25, remaining))
            return True
        finally:
            pubsub.close()

    # internals

    def _read_views(self, backend_ids: list[str]) -> list[BackendView]:
        rows, version = self._views(args=[self.prefix, *backend_ids])
        return [_view(row, version) for row in rows]

    @staticmethod
    def _not_found(backend_id: str) -> NotFound:
        return NotFound(f"no backend {backend_id!r}; GET /v1/backends lists the registered ones")


def _view(row: list[Any], version: Any) -> BackendView:
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


_health_clients: dict[int, httpx.Client] = {}


def _health_client() -> httpx.Client:
    """This process's client for health probes, made once: making one costs 20-60 ms of CPU (its
    SSL context), which the control worker paid at every probe round. No kept-alive connections:
    a backend may close an idle one, and a probe must not read that as a miss."""
    client = _health_clients.get(os.getpid())
    if client is None:
        client = _health_clients[os.getpid()] = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
    return client


def answers_health(url: str, timeout_s: float) -> bool:
    """Whether the server at ``url`` answers its health probe now."""
    return _answers_health(_health_client(), url.rstrip("/"), timeout_s)


def _answers_health(client: httpx.Client, url: str, timeout_s: float) -> bool:
    try:
        return client.get(f"{url}/health", timeout=timeout_s).is_success
    except (httpx.HTTPError, httpx.InvalidURL, ValueError):
        return False


# engine control: the service pauses, resumes and reloads its engines (vLLM's dev-mode RL routes,
# SGLang's, the reference server's)

PAUSE_MODES = ("keep", "wait", "abort")
ENGINE_RESUME_TIMEOUT_S = 30.0
_SGLANG_PAUSE_MODES = {"keep": "in_place", "wait": "in_place", "abort": "abort"}  # SGLang drains nothing itself


def _control_request(
    kind: str, action: str, mode: str, model_path: str
) -> tuple[str, dict[str, str], dict[str, Any] | None]:
    """(path, query, JSON body) of ``action`` ("pause" | "resume" | "update_weights") on a ``kind`` engine."""
    if action == "pause":
        if kind == "sglang":
            return "/pause_generation", {}, {"mode": _SGLANG_PAUSE_MODES[mode]}
        return "/pause", {"mode": mode}, None
    if action == "resume":
        return ("/continue_generation", {}, {}) if kind == "sglang" else ("/resume", {}, None)
    if kind == "vllm":  # in place, from the directory, on every worker (vLLM's CPU build included)
        return "/collective_rpc", {}, {"method": "reload_weights", "kwargs": {"weights_path": model_path}}
    return "/update_weights_from_disk", {}, {"model_path": model_path}


def _control_error(kind: str, path: str, response: httpx.Response) -> str | None:
    if response.status_code == 404 and kind == "vllm":
        return (
            f"HTTP 404 from POST {path}: start vLLM with VLLM_SERVER_DEV_MODE=1 for its RL routes "
            "(/pause, /resume, /collective_rpc)"
        )
    if not response.is_success:
        return f"HTTP {response.status_code} from POST {path}: {response.text[:500]}"
    if path == "/update_weights_from_disk":  # SGLang answers 200 {"success": false, "message"} too
        try:
            answer = response.json()
        except ValueError:
            return f"POST {path} answered no JSON: {response.text[:300]}"
        if isinstance(answer, dict) and answer.get("success") is False:
            return f"POST {path}: {answer.get('message', answer)}"
    return None


def _control_one(
    client: httpx.Client, view: BackendView, action: str, mode: str, model_path: str, timeout_s: float
) -> EngineResult:
    path, params, payload = _control_request(view.kind, action, mode, model_path)
    started = time.monotonic()
    try:
        response = client.post(f"{view.url}{path}", params=params, json=payload, timeout=timeout_s)
        error = _control_error(view.kind, path, response)
    except httpx.TimeoutException:
        error = f"no answer to POST {path} within {timeout_s:g} s"
    except (httpx.HTTPError, httpx.InvalidURL, ValueError) as exc:
        error = f"POST {path} failed: {type(exc).__name__}: {exc}"
    return EngineResult(
        backend_id=view.id,
        url=view.url,
        kind=view.kind,
        ok=error is None,
        error=error,
        seconds=round(time.monotonic() - started, 3),
    )


def control_engines(
    backends: list[BackendView], action: str, timeout_s: float, mode: str = "wait", model_path: str = ""
) -> list[EngineResult]:
    """Send ``action`` to every engine of ``backends`` at once; what each answered, in order (never raises)."""
    if not backends:
        return []
    client = _health_client()
    with ThreadPoolExecutor(min(PROBE_THREADS, len(backends))) as pool:
        return list(pool.map(lambda view: _control_one(client, view, action, mode, model_path, timeout_s), backends))
