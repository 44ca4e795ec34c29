"""Batches: K accepted GRPO groups with DAPO dynamic sampling, replenished as groups finish.

No coordinator process. Every state change of a batch is one Lua script, run by whoever
caused it: the gateway (submit, cancel; routes in rollout_service/gateway/api/batches.py), or the
control task ``batch_member_done`` that workers/dispatch.py sends when the job store reports a
member of a batch reaching a terminal state. When the last member
of a group is in, that script decides accepted / dropped, reserves replacement groups from
the task list up to ``max_inflight_groups``, and on the K-th acceptance closes the batch
and names the in-flight jobs to cancel — all in one atomic step, so concurrent or
redelivered events can never double-count or accept more than K groups.

Jobs are created outside Lua (by ``JobStore.create_jobs``), so a new group is first
*reserved* (no jobs yet), then its jobs are created and *attached* by a compare-and-set
script, and only then enqueued. What a crashed worker or a lost event leaves behind is
repaired later: the next event of the batch fills reservations older than 30 s, and
``BatchControl.heal`` (run by the long-poll of the batch's groups, at most every 5 s) also
redoes stale cancellations and decides terminal members whose event never arrived.

Keys, all under ``rollout:batch:<id>`` with the job TTL:

- ``(hash)``             status, reason, settings, counters, next_task
- ``:tasks`` (list)      the submitted tasks (JSON), by index
- ``:job`` (string)      the job fields every rollout shares (sampling, agent, ...; JSON)
- ``:groups`` (list)     every group started, in order
- ``:group:<gid>`` (hash) task_index, state (reserved | in_flight | accepted | dropped |
                          cancelled), slot:<k> job id, retries:<k>, result:<job> status|reward|reason
- ``:inflight`` (set)    reserved and running groups (counts against max_inflight_groups)
- ``:pending`` (zset)    reservations awaiting jobs: ``gid`` or ``gid#slot`` -> reserved at
- ``:accepted`` (list)   accepted group ids; the long-poll cursor indexes it
- ``:to_cancel`` (zset)  jobs the batch no longer needs -> since when
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import redis

from rollout_service.errors import NotFound, ValidationError
from rollout_service.schemas import (
    TERMINAL_STATUSES,
    BatchFilter,
    BatchGroup,
    BatchGroupsPage,
    BatchRequest,
    BatchStatus,
    BatchView,
    FinishReason,
    GroupRollout,
    JobRequest,
    JobStatus,
)
from rollout_service.state.connection import as_text
from rollout_service.state.enqueue import Enqueue
from rollout_service.state.keys import PREFIX, new_id
from rollout_service.state.store import JobStore
from rollout_service.tasks import first_stage

STALE_RESERVATION_S = 30.0  # a reservation this old lost its creator: heal re-creates its jobs
STALE_CANCEL_S = 10.0
STALE_MEMBER_S = 10.0  # a terminal member this long without a decision lost its event
HEAL_EVERY_S = 5.0
MAX_WAIT_S = 30.0
POLL_S = 0.05
WIRE_EXCLUDES = {"groups": {"__all__": {"rollouts": {"__all__": {"trajectory"}}}}}  # the SDK fills them in

Cancel = Callable[[str], None]

# ARGV[1] batch key, ARGV[2] now, ARGV[3] ttl; scripts add their own arguments after these.
_LUA_COMMON = """
local b, now, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local function key(part) return b .. ':' .. part end
local function gkey(gid) return b .. ':group:' .. gid end
local function num(field) return tonumber(redis.call('HGET', b, field)) end
local function touch(k) redis.call('EXPIRE', k, ttl) end

local function close(status, reason)
  redis.call('HSET', b, 'status', status, 'reason', reason, 'finished_at', now)
end

-- reserve groups from the task list until max_inflight are in flight; returns their ids
local function top_up()
  local reserved = {}
  local size = num('group_size')
  while redis.call('SCARD', key('inflight')) < num('max_inflight') do
    local index = num('next_task')
    if index >= num('n_tasks') then break end
    redis.call('HSET', b, 'next_task', index + 1)
    local gid = redis.call('HGET', b, 'group_prefix') .. index
    redis.call('HSET', gkey(gid), 'task_index', index, 'state', 'reserved')
    for s = 1, size do redis.call('HSET', gkey(gid), 'slot:' .. s, '', 'retries:' .. s, 0) end
    touch(gkey(gid))
    redis.call('SADD', key('inflight'), gid)
    redis.call('RPUSH', key('groups'), gid)
    redis.call('ZADD', key('pending'), now, gid)
    reserved[#reserved + 1] = gid
  end
  touch(key('inflight')); touch(key('groups')); touch(key('pending'))
  return reserved
end

local function end_if_exhausted()
  if redis.call('SCARD', key('inflight')) == 0 and num('next_task') >= num('n_tasks') then
    if num('accepted') == 0 and num('dropped_failed') > 0 then
      close('failed', 'tasks_exhausted')
    else
      close('completed', 'tasks_exhausted')
    end
  end
end

local function mark_to_cancel(jobs)
  for _, job in ipairs(jobs) do redis.call('ZADD', key('to_cancel'), now, job) end
  touch(key('to_cancel'))
end

-- the members of a group that have no result yet, and forget the group's reservations
local function unfinished_members(gid)
  local jobs = {}
  for s = 1, num('group_size') do
    local job = redis.call('HGET', gkey(gid), 'slot:' .. s)
    if job and job ~= '' and redis.call('HEXISTS', gkey(gid), 'result:' .. job) == 0 then
      jobs[#jobs + 1] = job
    end
    redis.call('ZREM', key('pending'), gid .. '#' .. s)
  end
  redis.call('ZREM', key('pending'), gid)
  return jobs
end

-- every in-flight group becomes cancelled; returns the jobs to cancel
local function cancel_in_flight()
  local jobs = {}
  local groups = redis.call('SMEMBERS', key('inflight'))
  for _, gid in ipairs(groups) do
    redis.call('HSET', gkey(gid), 'state', 'cancelled')
    for _, job in ipairs(unfinished_members(gid)) do jobs[#jobs + 1] = job end
  end
  redis.call('HINCRBY', b, 'cancelled_groups', #groups)
  redis.call('DEL', key('inflight'))
  mark_to_cancel(jobs)
  return jobs
end
"""

# -> reserved group ids
_START = (
    _LUA_COMMON
    + """
if redis.call('HGET', b, 'status') ~= 'running' then return {} end
local reserved = top_up()
end_if_exhausted()
return reserved
"""
)

# ARGV[4] group, ARGV[5] job, ARGV[6] job status, ARGV[7] reward, ARGV[8] finish reason
# -> {decision, batch status, jobs to cancel, reservations to fill}
_MEMBER_DONE = (
    _LUA_COMMON
    + """
local gid, job, status, reward = ARGV[4], ARGV[5], ARGV[6], ARGV[7]
local batch_status = redis.call('HGET', b, 'status')
if not batch_status then return {'unknown_batch', '', {}, {}} end
if batch_status ~= 'running' then return {'batch_over', batch_status, {}, {}} end
local group = gkey(gid)
if redis.call('HGET', group, 'state') ~= 'in_flight' then return {'not_in_flight', batch_status, {}, {}} end
local size = num('group_size')
local slot = nil
for s = 1, size do
  if redis.call('HGET', group, 'slot:' .. s) == job then slot = s end
end
if not slot then return {'not_a_member', batch_status, {}, {}} end
if redis.call('HSETNX', group, 'result:' .. job, status .. '|' .. reward .. '|' .. ARGV[8]) == 0 then
  return {'duplicate', batch_status, {}, {}}
end

local decision
local cancel = {}
if status ~= 'completed' then
  local retries = tonumber(redis.call('HGET', group, 'retries:' .. slot))
  if redis.call('HGET', b, 'on_failure') == 'retry_rollout' and retries < num('max_retries') then
    redis.call('HSET', group, 'retries:' .. slot, retries + 1, 'slot:' .. slot, '')
    redis.call('ZADD', key('pending'), now, gid .. '#' .. slot)
    redis.call('HINCRBY', b, 'retried', 1)
    return {'retry', batch_status, {}, {gid .. '#' .. slot}}
  end
  cancel = unfinished_members(gid)
  redis.call('HSET', group, 'state', 'dropped', 'drop_reason', 'failed_member')
  redis.call('SREM', key('inflight'), gid)
  redis.call('HINCRBY', b, 'dropped_failed', 1)
  mark_to_cancel(cancel)
  decision = 'dropped_failed'
else
  local rewards = {}
  for s = 1, size do
    local member = redis.call('HGET', group, 'slot:' .. s)
    local result = member ~= '' and redis.call('HGET', group, 'result:' .. member)
    if not result then return {'waiting', batch_status, {}, {}} end
    rewards[#rewards + 1] = tonumber(string.match(result, '^[^|]*|([^|]*)'))
  end
  local uniform = true
  for _, r in ipairs(rewards) do
    if math.abs(r - rewards[1]) > 1e-9 then uniform = false end
  end
  redis.call('SREM', key('inflight'), gid)
  if uniform and redis.call('HGET', b, 'filter') == 'nonuniform_reward' then
    redis.call('HSET', group, 'state', 'dropped', 'drop_reason', 'uniform_reward')
    redis.call('HINCRBY', b, 'dropped_uniform', 1)
    decision = 'dropped_uniform'
  else
    redis.call('HSET', group, 'state', 'accepted', 'accepted_at', now)
    redis.call('RPUSH', key('accepted'), gid)
    touch(key('accepted'))
    if redis.call('HINCRBY', b, 'accepted', 1) >= num('target') then
      local jobs = cancel_in_flight()
      close('completed', 'target_reached')
      return {'accepted', 'completed', jobs, {}}
    end
    decision = 'accepted'
  end
end
local reserved = top_up()
end_if_exhausted()
return {decision, redis.call('HGET', b, 'status'), cancel, reserved}
"""
)

# ARGV[4] group, ARGV[5] slot ('' for the whole group), ARGV[6..] job ids -> 1 attached | 0 not
_ATTACH = (
    _LUA_COMMON
    + """
local gid, slot = ARGV[4], ARGV[5]
local group = gkey(gid)
if redis.call('HGET', b, 'status') ~= 'running' then return 0 end
if slot == '' then
  if redis.call('HGET', group, 'state') ~= 'reserved' then return 0 end
  for i = 6, #ARGV do redis.call('HSET', group, 'slot:' .. (i - 5), ARGV[i]) end
  redis.call('HSET', group, 'state', 'in_flight')
  redis.call('ZREM', key('pending'), gid)
  return 1
end
if redis.call('HGET', group, 'state') ~= 'in_flight' then return 0 end
if redis.call('HGET', group, 'slot:' .. slot) ~= '' then return 0 end
redis.call('HSET', group, 'slot:' .. slot, ARGV[6])
redis.call('ZREM', key('pending'), gid .. '#' .. slot)
return 1
"""
)

# -> {batch status, jobs to cancel}
_CANCEL = (
    _LUA_COMMON
    + """
local status = redis.call('HGET', b, 'status')
if not status then return {'', {}} end
if status ~= 'running' then return {status, {}} end
local jobs = cancel_in_flight()
close('cancelled', 'cancelled')
return {'cancelled', jobs}
"""
)


@dataclass
class Decision:
    kind: str
    batch_status: str = ""
    cancel: list[str] = field(default_factory=list)
    reserved: list[str] = field(default_factory=list)


def batch_key(batch_id: str) -> str:
    return f"{PREFIX}:batch:{batch_id}"


class BatchStore:
    """Batch state in Redis. Every mutation is one of the Lua scripts above."""

    def __init__(self, client: redis.Redis, ttl_s: int) -> None:
        self.redis = client
        self.ttl_s = ttl_s
        self._start = client.register_script(_START)
        self._member_done = client.register_script(_MEMBER_DONE)
        self._attach = client.register_script(_ATTACH)
        self._cancel = client.register_script(_CANCEL)

    def _args(self, batch_id: str, *extra: Any) -> list[Any]:
        return [batch_key(batch_id), time.time(), self.ttl_s, *extra]

    def _key(self, batch_id: str, part: str = "") -> str:
        return batch_key(batch_id) + (f":{part}" if part else "")

    # -- mutations ------------------------------------------------------------------
    def create(self, request: BatchRequest) -> tuple[str, list[str]]:
        """Store a new running batch and reserve its first groups: (batch_id, reserved group ids)."""
        batch_id = new_id("batch")
        max_inflight = request.max_inflight_groups or request.target_groups
        job_fields = request.model_dump(
            mode="json", include={"sampling", "agent", "timeouts", "max_policy_lag", "metadata"}
        )
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(
            self._key(batch_id),
            mapping={
                "status": BatchStatus.running.value,
                "reason": "",
                "created_at": time.time(),
                "finished_at": "",
                "target": request.target_groups,
                "group_size": request.group_size,
                "max_inflight": max_inflight,
                "filter": request.filter.value,
                "on_failure": request.on_failure.value,
                "max_retries": request.max_rollout_retries,
                "n_tasks": len(request.tasks),
                "next_task": 0,
                "group_prefix": f"group-{batch_id[6:]}-",
                "accepted": 0,
                "dropped_uniform": 0,
                "dropped_failed": 0,
                "cancelled_groups": 0,
                "retried": 0,
            },
        )
        pipe.rpush(self._key(batch_id, "tasks"), *(json.dumps(t) for t in request.tasks))
        pipe.set(self._key(batch_id, "job"), json.dumps(job_fields))
        for part in ("", "tasks", "job"):
            pipe.expire(self._key(batch_id, part), self.ttl_s)
        pipe.execute()
        return batch_id, [as_text(r) for r in self._start(args=self._args(batch_id))]

    def member_done(
        self, batch_id: str, group_id: str, job_id: str, status: str, reward: str, finish_reason: str
    ) -> Decision:
        kind, batch_status, cancel, reserved = self._member_done(
            args=self._args(batch_id, group_id, job_id, status, reward, finish_reason)
        )
        return Decision(
            as_text(kind), as_text(batch_status), [as_text(j) for j in cancel], [as_text(r) for r in reserved]
        )

    def attach(self, batch_id: str, group_id: str, slot: int | None, job_ids: list[str]) -> bool:
        """Give a reservation its jobs, unless the batch or group moved on (then: False)."""
        return bool(self._attach(args=self._args(batch_id, group_id, "" if slot is None else slot, *job_ids)))

    def cancel(self, batch_id: str) -> list[str]:
        status, jobs = self._cancel(args=self._args(batch_id))
        if not status:
            raise self._missing(batch_id)
        return [as_text(j) for j in jobs]

    def forget_cancelled(self, batch_id: str, job_ids: list[str]) -> None:
        if job_ids:
            self.redis.zrem(self._key(batch_id, "to_cancel"), *job_ids)

    # -- reading --------------------------------------------------------------------
    def fields(self, batch_id: str) -> dict[str, str]:
        raw = cast("dict[bytes, bytes]", self.redis.hgetall(self._key(batch_id)))
        if not raw:
            raise self._missing(batch_id)
        return {as_text(k): as_text(v) for k, v in raw.items()}

    def status(self, batch_id: str) -> BatchStatus:
        value = cast("bytes | None", self.redis.hget(self._key(batch_id), "status"))
        if value is None:
            raise self._missing(batch_id)
        return BatchStatus(as_text(value))

    def job_fields(self, batch_id: str) -> dict[str, Any]:
        return json.loads(cast("bytes | None", self.redis.get(self._key(batch_id, "job"))) or "{}")

    def task(self, batch_id: str, index: int) -> dict[str, Any]:
        task = cast("bytes | None", self.redis.lindex(self._key(batch_id, "tasks"), index))
        if task is None:
            raise self._missing(batch_id)
        return json.loads(task)

    def group(self, batch_id: str, group_id: str) -> dict[str, str]:
        raw = cast("dict[bytes, bytes]", self.redis.hgetall(self._key(batch_id, f"group:{group_id}")))
        return {as_text(k): as_text(v) for k, v in raw.items()}

    def group_ids(self, batch_id: str) -> list[str]:
        return [as_text(gid) for gid in cast("list[bytes]", self.redis.lrange(self._key(batch_id, "groups"), 0, -1))]

    def pending(self, batch_id: str, older_than_s: float = 0.0) -> list[str]:
        return self._older_than(self._key(batch_id, "pending"), older_than_s)

    def to_cancel(self, batch_id: str, older_than_s: float = 0.0) -> list[str]:
        return self._older_than(self._key(batch_id, "to_cancel"), older_than_s)

    def _older_than(self, zset_key: str, older_than_s: float) -> list[str]:
        members = cast("list[bytes]", self.redis.zrangebyscore(zset_key, "-inf", time.time() - older_than_s))
        return [as_text(m) for m in members]

    def in_flight_groups(self, batch_id: str) -> list[str]:
        return [as_text(gid) for gid in cast("set[bytes]", self.redis.smembers(self._key(batch_id, "inflight")))]

    def view(self, batch_id: str) -> BatchView:
        f = self.fields(batch_id)
        n_tasks, next_task = int(f["n_tasks"]), int(f["next_task"])
        cancelled = (
            [
                int(grp["task_index"])
                for grp in self._groups(batch_id, self.group_ids(batch_id))
                if grp.get("state") == "cancelled"
            ]
            if f["status"] != BatchStatus.running.value
            else []
        )
        unstarted_raw = cast("list[bytes]", self.redis.lrange(self._key(batch_id, "tasks"), next_task, -1))
        unstarted = [json.loads(t) for t in unstarted_raw]
        dropped_uniform, dropped_failed = int(f["dropped_uniform"]), int(f["dropped_failed"])
        return BatchView(
            batch_id=batch_id,
            status=BatchStatus(f["status"]),
            reason=f["reason"] or None,
            target_groups=int(f["target"]),
            group_size=int(f["group_size"]),
            accepted=int(f["accepted"]),
            dropped=dropped_uniform + dropped_failed,
            dropped_uniform=dropped_uniform,
            dropped_failed=dropped_failed,
            in_flight=self.in_flight_count(batch_id),
            cancelled_groups=int(f["cancelled_groups"]),
            retried_rollouts=int(f["retried"]),
            tasks_total=n_tasks,
            tasks_started=next_task,
            remaining_tasks=[self.task(batch_id, i) for i in cancelled] + unstarted,
            remaining_task_indices=cancelled + list(range(next_task, n_tasks)),
            created_at=float(f["created_at"]),
            finished_at=float(f["finished_at"]) if f["finished_at"] else None,
        )

    def in_flight_count(self, batch_id: str) -> int:
        return cast(int, self.redis.scard(self._key(batch_id, "inflight")))

    def accepted_count(self, batch_id: str) -> int:
        return cast(int, self.redis.llen(self._key(batch_id, "accepted")))

    def groups_after(self, batch_id: str, cursor: int) -> BatchGroupsPage:
        status = self.status(batch_id)  # read first: "over" then means every group is in the list
        accepted_raw = cast("list[bytes]", self.redis.lrange(self._key(batch_id, "accepted"), cursor, -1))
        accepted = [as_text(gid) for gid in accepted_raw]
        groups = [
            self._accepted_group(batch_id, gid, grp) for gid, grp in zip(accepted, self._groups(batch_id, accepted))
        ]
        f = self.fields(batch_id)
        return BatchGroupsPage(
            groups=groups,
            cursor=str(cursor + len(groups)),
            status=status,
            done=status != BatchStatus.running,
            accepted=int(f["accepted"]),
            dropped=int(f["dropped_uniform"]) + int(f["dropped_failed"]),
            in_flight=self.in_flight_count(batch_id),
        )

    def _groups(self, batch_id: str, group_ids: list[str]) -> list[dict[str, str]]:
        pipe = self.redis.pipeline(transaction=False)
        for gid in group_ids:
            pipe.hgetall(self._key(batch_id, f"group:{gid}"))
        return [{as_text(k): as_text(v) for k, v in raw.items()} for raw in pipe.execute()]

    def _accepted_group(self, batch_id: str, group_id: str, grp: dict[str, str]) -> BatchGroup:
        rollouts = []
        for slot in range(1, sum(1 for k in grp if k.startswith("slot:")) + 1):
            job_id = grp[f"slot:{slot}"]
            status, reward, reason = grp[f"result:{job_id}"].split("|")
            rollouts.append(
                GroupRollout(
                    job_id=job_id,
                    status=JobStatus(status),
                    reward=float(reward),
                    finish_reason=FinishReason(reason) if reason else None,
                )
            )
        rewards = [r.reward or 0.0 for r in rollouts]
        return BatchGroup(
            group_id=group_id,
            task_index=int(grp["task_index"]),
            task=self.task(batch_id, int(grp["task_index"])),
            rollouts=rollouts,
            reward_mean=statistics.fmean(rewards),
            reward_std=statistics.stdev(rewards) if len(rewards) > 1 else 0.0,
        )

    @staticmethod
    def _missing(batch_id: str) -> NotFound:
        return NotFound(f"no batch {batch_id!r}: it never existed or its TTL expired")


def cancel_member(jobs: JobStore, job_id: str) -> None:
    """Cancel one rollout the batch no longer needs (the batch accounts for it: no event)."""
    with contextlib.suppress(NotFound):
        jobs.cancel(job_id, announce=False)


class BatchControl:
    """What the gateway and the control task do to a batch: submit, react to a finished member,
    cancel, and heal what a crashed worker left half done."""

    def __init__(self, jobs: JobStore, enqueue: Enqueue, cancel: Cancel | None = None) -> None:
        self.jobs = jobs
        self.batches = BatchStore(jobs.redis, jobs.settings.job_ttl_s)
        self.enqueue = enqueue
        self.cancel_job = cancel or (lambda job_id: cancel_member(jobs, job_id))

    def submit(self, request: BatchRequest) -> str:
        validate(request)
        batch_id, reserved = self.batches.create(request)
        self.materialize(batch_id, reserved)
        return batch_id

    def member_done(self, job_id: str) -> str:
        """Account for one finished member of a batch; returns the decision (for logs and tests)."""
        try:
            f = self.jobs.fields(job_id)
        except NotFound:
            return "unknown_job"
        batch_id = f.get("batch_id", "")
        if not batch_id:
            return "not_in_a_batch"
        status = JobStatus(f["status"])
        if status not in TERMINAL_STATUSES:
            return "not_terminal"
        reward = f.get("reward", "")
        if status == JobStatus.completed and reward == "":
            status = JobStatus.failed  # a completed job without a reward is not a reward of 0
        decision = self.batches.member_done(
            batch_id, f["group_id"], job_id, status.value, reward, f.get("finish_reason", "")
        )
        self.materialize(batch_id, decision.reserved)
        self.cancel_jobs(batch_id, decision.cancel)
        self.materialize(batch_id, self.batches.pending(batch_id, STALE_RESERVATION_S))
        return decision.kind

    def cancel(self, batch_id: str) -> BatchView:
        self.cancel_jobs(batch_id, self.batches.cancel(batch_id))
        return self.batches.view(batch_id)

    def heal(self, batch_id: str) -> None:
        """Finish what a lost event or a crashed worker left behind (rate-limited per batch):
        stale reservations get their jobs, stale cancellations are redone, and terminal members
        without a decision are decided."""
        if not self.jobs.redis.set(f"{batch_key(batch_id)}:healing", 1, nx=True, px=int(HEAL_EVERY_S * 1000)):
            return
        self.materialize(batch_id, self.batches.pending(batch_id, STALE_RESERVATION_S))
        self.cancel_jobs(batch_id, self.batches.to_cancel(batch_id, STALE_CANCEL_S))
        for job_id in self._undecided_members(batch_id):
            self.member_done(job_id)

    # -- steps --------------------------------------------------------------------
    def materialize(self, batch_id: str, reservations: list[str]) -> None:
        """Create, attach and enqueue the jobs of reserved groups (``gid``) or retried slots (``gid#k``)."""
        if not reservations:
            return
        job_fields = self.batches.job_fields(batch_id)
        group_size = int(self.batches.fields(batch_id)["group_size"])
        for reservation in reservations:
            group_id, _, slot_text = reservation.partition("#")
            slot = int(slot_text) if slot_text else None
            grp = self.batches.group(batch_id, group_id)
            waiting = (
                grp.get("state") == "reserved"
                if slot is None
                else grp.get("state") == "in_flight" and grp.get(f"slot:{slot}") == ""
            )
            if not waiting:
                continue
            task = self.batches.task(batch_id, int(grp["task_index"]))
            request = JobRequest.model_validate({**job_fields, "task": task, "n": 1 if slot else group_size})
            job_ids, _ = self.jobs.create_jobs(request, group_id=group_id, batch_id=batch_id)
            if self.batches.attach(batch_id, group_id, slot, job_ids):
                self.enqueue(job_ids, first_stage(request, self.jobs.settings))
            else:  # someone else filled it, or the batch is over: these were never enqueued
                for job_id in job_ids:
                    self.jobs.transition(
                        job_id, JobStatus.cancelled, finish_reason=FinishReason.cancelled.value, finished_at=time.time()
                    )

    def cancel_jobs(self, batch_id: str, job_ids: list[str]) -> None:
        for job_id in job_ids:
            self.cancel_job(job_id)
        self.batches.forget_cancelled(batch_id, job_ids)

    def _undecided_members(self, batch_id: str) -> list[str]:
        undecided = []
        for gid in self.batches.in_flight_groups(batch_id):
            grp = self.batches.group(batch_id, gid)
            members = [v for k, v in grp.items() if k.startswith("slot:") and v]
            for job_id in members:
                if f"result:{job_id}" in grp:
                    continue
                fields = cast(
                    "list[bytes | None]", self.jobs.redis.hmget(JobStore.key(job_id), ["status", "finished_at"])
                )
                status, finished_at = (as_text(v) if v is not None else "" for v in fields)
                if (
                    status in {s.value for s in TERMINAL_STATUSES}
                    and finished_at
                    and time.time() - float(finished_at) > STALE_MEMBER_S
                ):
                    undecided.append(job_id)
        return undecided


def validate(request: BatchRequest) -> None:
    """What a schema cannot check: the task list against the targets, and every task's fields."""
    from rollout_service.tasks import get_handler

    if request.target_groups > len(request.tasks):
        raise ValidationError(
            f"target_groups ({request.target_groups}) exceeds the number of tasks ({len(request.tasks)}): "
            "each task makes at most one group; pass more tasks or lower target_groups"
        )
    if request.filter == BatchFilter.nonuniform_reward and request.group_size < 2:
        raise ValidationError(
            "filter 'nonuniform_reward' needs group_size >= 2: a group of one always has "
            "uniform rewards and would never be accepted"
        )
    for i, task in enumerate(request.tasks):
        try:
            get_handler(task["domain"]).validate(task)
        except ValidationError as exc:
            raise ValidationError(f"tasks[{i}]: {exc.message}") from None
