"""Sticky assignment over the load heap: which backend each job calls, and the call that makes it.

A job keeps its backend while that backend is registered, healthy and serves the job's model; else
it gets the least-loaded healthy backend of the model's pool (``heap:{model}`` scored by live
assignments). Every mutation is one Lua script, so counts stay exact with any number of concurrent
workers and a crash can never lose or double-count an assignment. The scripts that start an LLM
call also check the job's cancel flag and the weight-sync pause and count the call in flight, so a
call costs one round trip.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import redis

from rollout_service.concurrency.autopipeline import fire, submit
from rollout_service.errors import NoBackendAvailable, ValidationError
from rollout_service.schemas import BackendView
from rollout_service.state.backends.layout import LUA_KEYS, backend_key, lua_keys, view_of
from rollout_service.state.connection import as_text, scripts_of
from rollout_service.state.job_scripts import BEGIN_STAGE_ARGS, BEGIN_STAGE_FUNCTION, stage_end_scripts
from rollout_service.state.store import BeginCall, EndCall


class AllBackendsDown(NoBackendAvailable):
    """Every backend of the model is unhealthy (its engines may be restarting): worth waiting for."""


FirstCall = Callable[[], tuple[BackendView | str, bool]]  # Assignments.first_call_soon's answer

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
_LUA_ACQUIRE = LUA_KEYS + _ACQUIRE_FUNCTION

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
    + lua_keys(BEGIN_STAGE_ARGS + 1)
    + _ACQUIRE_FUNCTION
    + """
local begun, fields = begin_stage()
if begun[1] ~= 'ok' then return {begun, false} end
local job = ARGV[BEGIN_STAGE_ARGS + 2]
local model = fields[7]
if not model then return {begun, {'later'}} end
if redis.call('EXISTS', key('paused')) == 1 then return {begun, {'paused'}} end
local answer = acquire(job, model)
if answer[1] == 'ok' then redis.call('HINCRBY', key('calls'), job, 1) end
return {begun, answer}
""".replace("BEGIN_STAGE_ARGS", str(BEGIN_STAGE_ARGS))
)

_RELEASE_FUNCTION = """
local function release(job)
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
end
"""

_RELEASE = LUA_KEYS + _RELEASE_FUNCTION + "return release(ARGV[2])"

# The stage's end scripts that then release the job's backend: ARGV after the end's own: prefix, job.
_END_RELEASING, _MOVE_AND_END_RELEASING = stage_end_scripts(
    lua_keys("last + 1") + _RELEASE_FUNCTION + "release(ARGV[last + 2])", then_args=2
)

_RECONCILE = (
    LUA_KEYS
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


class Assignments:
    """Acquire and release jobs' backends; start a job's LLM calls (the first one with its stage's begin)."""

    def __init__(self, redis_client: redis.Redis, prefix: str) -> None:
        self.redis = redis_client
        self.prefix = prefix
        (
            self._acquire,
            self._start_call,
            self._release,
            self._reconcile,
            self._begin_run,
            self._end_releasing,
            self._move_and_end_releasing,
        ) = scripts_of(
            redis_client,
            _ACQUIRE,
            _START_CALL,
            _RELEASE,
            _RECONCILE,
            _BEGIN_RUN,
            _END_RELEASING,
            _MOVE_AND_END_RELEASING,
        )

    def backend_of(self, job_id: str) -> str | None:
        """The job's sticky backend id, if it holds one."""
        value = self.redis.get(backend_key(self.prefix, "job", job_id))
        return None if value is None else as_text(value)

    def acquire(self, job_id: str, model: str | None) -> BackendView:
        """The job's backend: its sticky one while registered, healthy and serving ``model``;
        else the least-loaded healthy backend of the model's pool (``model`` None: the only
        model, or the model of the job's previous backend). Cheap enough to call before every
        LLM call, which is how a job follows a removal or a failed health probe."""
        return _granted(self._acquire(args=[self.prefix, job_id, model or ""]))

    def start_call(self, job_id: str, model: str | None, job_key: str) -> BackendView | str:
        """Everything before an LLM call in one round trip: ``"cancelled"`` if the job hash at
        ``job_key`` has its cancel flag up, ``"paused"`` during a weight sync, else the job's
        backend (as ``acquire``) with the call counted in flight (``InflightCalls.end_call`` ends it)."""
        reply = self._start_call(args=[self.prefix, job_id, model or "", job_key])
        status = as_text(reply[0])
        return status if status in ("cancelled", "paused") else _granted(reply)

    def first_call_soon(self, job_id: str, job_key: str) -> FirstCall:
        """``start_call`` for a job's first LLM call, sent now and answered when the result is
        called: a green run worker sends it with the stage's begin, in one round trip. Only for a
        job whose episode calls the LLM first (init records its model; no sandbox or harness to
        start before, which would hold a counted call while a trainer waits to sync weights);
        ``"later"`` for the others. The answer also says whether this call made the job's
        assignment (``BackendPool.drop_first_call`` undoes an unused one)."""
        return _first_call_answer(submit(self.redis, self._start_call, args=[self.prefix, job_id, "", job_key, "1"]))

    def first_call_with_begin(self, job_id: str, answers: list[FirstCall]) -> BeginCall:
        """``first_call_soon`` made by the script that begins the job's run stage
        (``JobStore.begin_stages(calls=...)``): one script call for both, and none for a job whose
        stage does not begin. Its answer is appended to ``answers``."""

        def answered(reply: Any) -> None:
            if reply is not None:
                answers.append(_first_call_answer(lambda: reply))

        return BeginCall(self._begin_run, [self.prefix, job_id], answered)

    def release(self, job_id: str) -> None:
        """The job is done with its backend (a green worker does not wait: its client's next
        call, e.g. the end of the stage, is sent after this one)."""
        fire(self.redis, self._release, args=[self.prefix, job_id])

    def release_with_end(self, job_id: str) -> EndCall:
        """``release`` made by the script that ends the job's stage (``StageEnd.call``): no script
        call of its own."""
        return EndCall(self._end_releasing, self._move_and_end_releasing, [self.prefix, job_id])

    def reconcile(self, live_job_ids: Iterable[str]) -> int:
        """Drop assignments of jobs that are not live (leaked by dead workers); recompute every score."""
        return int(self._reconcile(args=[self.prefix, *live_job_ids]))


def _first_call_answer(pending: Callable[[], Any]) -> FirstCall:
    replies: list[Any] = []  # read once: prepare and the first call both ask

    def answer() -> tuple[BackendView | str, bool]:
        if not replies:
            replies.append(pending())
        reply = replies[0]
        status = as_text(reply[0])
        if status in ("cancelled", "paused", "later"):
            return status, False
        if len(replies) == 1:
            replies.append((_granted(reply), as_text(reply[3]) == "1"))
        granted: tuple[BackendView, bool] = replies[1]
        return granted

    return answer


def _granted(reply: list[Any]) -> BackendView:
    """The backend of an ``acquire`` answer, or the exception its error names."""
    status = as_text(reply[0])
    if status == "ok":
        return view_of(reply[1], reply[2])
    rest = [as_text(part) for part in reply[1:]]
    if status == "no_models":
        raise NoBackendAvailable(
            "no inference backend is registered; register one with POST /v1/backends "
            '{"url": ..., "kind": "vllm" | "sglang" | "reference", "model": ...}'
        )
    if status == "ambiguous":
        raise ValidationError(
            f"several models are served ({', '.join(sorted(rest))}); set sampling.model to the one this job should use"
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
