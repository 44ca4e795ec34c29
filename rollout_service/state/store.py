"""Job state in Redis: one hash per job, msgpack blobs beside it, all with a TTL.

Status changes go through one Lua script so a job reaches exactly one terminal state,
whatever redeliveries, cancels and deadlines race for it.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any

import msgpack
import redis
from redis.backoff import ExponentialBackoff
from redis.commands.core import Script
from redis.retry import Retry

from rollout_service.concurrency.green import green_process
from rollout_service.errors import ConfigError, Conflict, NotFound, StoreUnavailable
from rollout_service.schemas import (
    TERMINAL_STATUSES,
    ErrorInfo,
    JobRequest,
    JobStatus,
    JobView,
    Timings,
    Trajectory,
)
from rollout_service.settings import Settings, get_settings
from rollout_service.state.metrics_recording import Increments, count_jobs_finished, record_job_finished
from rollout_service.tasks import first_stage


def _remember_redis_version() -> None:
    """redis-py looks its own version up in its package metadata (an email-format parse, ~0.33 ms
    of the ~0.37 ms a connection costs) every time it makes a connection (kombu's acks and the
    green workers' pools made ~100 over a 1000 x 4 bench's life). The version does not change."""
    import redis.utils

    if not hasattr(redis.utils.get_lib_version, "cache_info"):
        redis.utils.get_lib_version = functools.lru_cache(maxsize=1)(redis.utils.get_lib_version)


_remember_redis_version()

PREFIX = "rollout"
LIVE_JOBS = f"{PREFIX}:jobs:live"
JOB_INDEX = f"{PREFIX}:jobs:index"  # zset: job id -> creation sequence number (newest = highest)
JOB_SEQUENCE = f"{PREFIX}:jobs:seq"
FINISHED_CHANNEL = f"{PREFIX}:jobs:finished"  # pub/sub: a job id each time a job reaches a terminal state
CANCEL_CHANNEL = f"{PREFIX}:jobs:cancel"  # pub/sub: a job id each time a job's cancel flag goes up
STAGES = ("init", "run", "eval")
TRANSIENT_REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError)
VIEW_FIELDS = (
    "status",
    "group_id",
    "batch_id",
    "created_at",
    "init_start",
    "init_end",
    "run_start",
    "run_end",
    "eval_start",
    "eval_end",
    "sandbox_boot_s",
    "sandbox_wait_s",
    "reward",
    "finish_reason",
    "error_code",
    "error_message",
    "backend_id",
    "attempts_init",
    "attempts_run",
    "attempts_eval",
    "metadata",
)

OnFinished = Callable[[str, str], None]  # (job id, batch id or "") once a job reached a terminal state
_ON_FINISHED: list[OnFinished] = []


def on_job_finished(hook: OnFinished) -> None:
    """Register ``hook`` for every JobStore of this process (workers/dispatch.py registers the batch event)."""
    if hook not in _ON_FINISHED:
        _ON_FINISHED.append(hook)


# What a terminal move answers with: the fields the metrics and the finish hooks read.
ENDED_FIELDS = (
    "status",
    "finish_reason",
    "batch_id",
    "created_at",
    "init_start",
    "init_end",
    "run_start",
    "run_end",
    "eval_start",
    "eval_end",
    "attempts_init",
    "attempts_run",
    "attempts_eval",
)

# A status move. KEYS: job hash, live set, finished channel. ARGV from ``o``: status, allowed from
# (comma-separated, '' any), '1' if terminal, job id, then field, value pairs.
_MOVE = """
local function move(o)
  local cur = redis.call('HGET', KEYS[1], 'status')
  if not cur then return -1 end
  if cur == 'completed' or cur == 'failed' or cur == 'cancelled' or cur == 'timed_out' then return 0 end
  if ARGV[o + 1] ~= '' then
    local ok = false
    for s in string.gmatch(ARGV[o + 1], '[^,]+') do if s == cur then ok = true end end
    if not ok then return 0 end
  end
  redis.call('HSET', KEYS[1], 'status', ARGV[o], unpack(ARGV, o + 4))
  if ARGV[o + 2] == '1' then
    redis.call('SREM', KEYS[2], ARGV[o + 3])
    redis.call('PUBLISH', KEYS[3], ARGV[o + 3])
    return redis.call('HMGET', KEYS[1], ENDED_FIELDS)
  end
  return 1
end
""".replace("ENDED_FIELDS", ", ".join(f"'{name}'" for name in ENDED_FIELDS))

_TRANSITION = _MOVE + "return move(1)"

# Everything a stage checks and records before its body, in one round trip, as a Lua function other
# scripts can begin with (backends.py: the run stage's begin with its first LLM call).
# KEYS: job hash, job lease. ARGV: previous status, stage status, lease owner, lease ttl ms,
# attempts field, start field, now, end field (a stage that already ended never runs again),
# a status the stage may also begin from ('' none) and the field stamped then (the run stage of a
# job that skipped init: it begins from queued and stamps init_start).
BEGIN_STAGE_FUNCTION = """
local function begin_stage()
  local f = redis.call('HMGET', KEYS[1], 'status', 'cancel_requested', 'deadline_at', 'rollout_index', ARGV[8],
                       ARGV[5])
  if not f[1] then return {'missing'} end
  local skipped = f[1] == ARGV[9]
  if (f[1] ~= ARGV[1] and f[1] ~= ARGV[2] and not skipped) or f[5] then return {'skip', f[1]} end
  if f[2] == '1' then return {'cancelled'} end
  if not redis.call('SET', KEYS[2], ARGV[3], 'NX', 'PX', ARGV[4]) then return {'leased'} end
  local attempts = tonumber(f[6] or '0') + 1
  if skipped then redis.call('HSET', KEYS[1], 'status', ARGV[2], ARGV[5], attempts, ARGV[6], ARGV[7], ARGV[10], ARGV[7])
  else redis.call('HSET', KEYS[1], 'status', ARGV[2], ARGV[5], attempts, ARGV[6], ARGV[7]) end
  return {'ok', f[3], attempts, f[4] or '0'}
end
"""
BEGIN_STAGE_ARGS = 10  # a script that begins with begin_stage() reads its own ARGV after these
_BEGIN_STAGE = BEGIN_STAGE_FUNCTION + "return begin_stage()"

_END_STAGE = """
if redis.call('GET', KEYS[2]) == ARGV[1] then redis.call('DEL', KEYS[2]) end
if #ARGV > 1 then redis.call('HSET', KEYS[1], unpack(ARGV, 2)) end
return redis.call('HGET', KEYS[1], 'status')
"""

# A stage's end with a move first: {what _TRANSITION answers, the status after}. KEYS: job hash, live
# set, finished channel, lease. ARGV: lease owner, n, n args of field, value pairs, the move's ARGV
# (whose field, value pairs end with the same n: a move sets them with its own).
_MOVE_AND_END_STAGE = (
    _MOVE
    + """
local n = tonumber(ARGV[2])
local moved = move(n + 3)
if redis.call('GET', KEYS[4]) == ARGV[1] then redis.call('DEL', KEYS[4]) end
if moved == -1 then return {moved, false} end
if moved ~= 0 then return {moved, ARGV[n + 3]} end
if n > 0 then redis.call('HSET', KEYS[1], unpack(ARGV, 3, n + 2)) end
return {moved, redis.call('HGET', KEYS[1], 'status')}
"""
)

_RENEW_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


def resolve_redis_url(settings: Settings) -> str:
    if settings.redis_url:
        return settings.redis_url
    recorded = settings.state_path / "redis.url"
    if recorded.exists():
        return recorded.read_text().strip()
    raise ConfigError(
        "no Redis configured: set ROLLOUT_REDIS_URL=redis://host:port/0, or run "
        "`rollout-service up` (it starts one and records it under ROLLOUT_STATE_DIR)"
    )


@functools.lru_cache(maxsize=8)
def _client_for(url: str, socket_timeout_s: float, connect_timeout_s: float, retries: int) -> redis.Redis:
    """One client per process and URL that rides out a Redis blip: deliberate timeouts, every
    command retried ``retries`` times with exponential backoff on connection errors and timeouts.
    Its pool blocks when all connections are busy (hundreds of episodes share a few dozen
    connections) instead of failing with "Too many connections"."""
    settings = get_settings()
    pool = redis.BlockingConnectionPool.from_url(
        url,
        max_connections=settings.redis_max_connections,
        timeout=settings.redis_pool_wait_s,
        health_check_interval=30,
        socket_keepalive=True,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=connect_timeout_s,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
    )
    return client_class()(connection_pool=pool)


def client_class() -> type[redis.Redis]:
    """Green worker processes (gevent pools) share round trips across greenlets; others load
    their scripts once."""
    from rollout_service.concurrency.autopipeline import AutoPipelineRedis, ScriptLoadingRedis

    return AutoPipelineRedis if green_process() else ScriptLoadingRedis


_script_sets: dict[tuple[int, tuple[str, ...]], list[Script]] = {}


def scripts_of(client: redis.Redis, *sources: str) -> list[Script]:
    """``client.register_script`` of each source, made once per client and set of sources (a store
    or a backend pool is built per episode; registering hashes and encodes every script again)."""
    known = _script_sets.get((id(client), sources))
    if known is None or known[0].registered_client is not client:
        known = _script_sets[id(client), sources] = [client.register_script(source) for source in sources]
    return known


def redis_client(settings: Settings | None = None) -> redis.Redis:
    settings = settings or get_settings()
    return _client_for(
        resolve_redis_url(settings),
        settings.redis_socket_timeout_s,
        settings.redis_connect_timeout_s,
        settings.redis_retries,
    )


def broker_client(state: redis.Redis, settings: Settings | None = None) -> redis.Redis:
    """The Redis holding Celery's queues: ROLLOUT_BROKER_URL's, or ``state`` when the broker
    shares the state's Redis."""
    settings = settings or get_settings()
    if not settings.broker_url:
        return state
    return _client_for(
        settings.broker_url, settings.redis_socket_timeout_s, settings.redis_connect_timeout_s, settings.redis_retries
    )


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


class Packed(bytes):
    """A blob already in msgpack: a stage's result stored as it is."""


def with_field(blob: bytes, name: str, value: Any) -> Packed:
    """``blob``, a msgpack map, with entry ``name`` set to ``value`` and every other byte as it was:
    the map is walked (values skipped in C), not decoded and packed again. A trajectory of 8k
    tokens costs a millisecond or two to decode and pack; this is a copy."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(blob)
    for _ in range(unpacker.read_map_header()):
        key = unpacker.unpack()
        start = unpacker.tell()
        unpacker.skip()
        if key == name:
            return Packed(blob[:start] + pack(value) + blob[unpacker.tell() :])
    return Packed(pack({**unpack(blob), name: value}))


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def as_text(value: Any) -> str:
    """A Redis reply (bytes) or a plain value as str."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _float(value: str | None) -> float | None:
    return float(value) if value else None


@dataclass
class StageEnd:
    """What ends a job's stage, in this order: blobs stored, a terminal move (status, its fields and
    ``fields``) or else ``fields`` set, the lease released."""

    job_id: str
    owner: str
    fields: dict[str, Any] = dataclass_field(default_factory=dict)
    blobs: dict[str, Any] = dataclass_field(default_factory=dict)
    finish: tuple[JobStatus, dict[str, Any]] | None = None


@dataclass
class BeginCall:
    """A script a job's stage begins with instead of the plain begin: it starts with
    ``BEGIN_STAGE_FUNCTION``, reads ``args`` after the begin's ARGV and answers ``{begin_stage()'s
    answer, its own}``; ``answered`` takes its own answer."""

    script: Script
    args: list[Any]
    answered: Callable[[Any], None]


class JobStore:
    def __init__(
        self, client: redis.Redis, settings: Settings | None = None, on_finished: list[OnFinished] | None = None
    ) -> None:
        self.redis = client
        self.settings = settings or get_settings()
        self.on_finished = _ON_FINISHED if on_finished is None else on_finished
        (self._transition, self._renew_lease, self._begin_stage, self._end_stage, self._move_and_end_stage) = (
            scripts_of(client, _TRANSITION, _RENEW_LEASE, _BEGIN_STAGE, _END_STAGE, _MOVE_AND_END_STAGE)
        )

    @staticmethod
    def key(job_id: str, part: str = "") -> str:
        return f"{PREFIX}:job:{job_id}" + (f":{part}" if part else "")

    # -- submission -------------------------------------------------------------------
    def create_jobs(
        self, request: JobRequest, group_id: str | None = None, batch_id: str = ""
    ) -> tuple[list[str], str]:
        return self.create_many([request], group_id=group_id, batch_id=batch_id)[0]

    def create_many(
        self, requests: list[JobRequest], group_id: str | None = None, batch_id: str = ""
    ) -> list[tuple[list[str], str]]:
        """Write the records of every request's jobs (one group per request) in one pipeline."""
        total = sum(r.n for r in requests)
        last_seq = int(self._call(self.redis.incrby, JOB_SEQUENCE, total))
        seq = last_seq - total
        now = time.time()
        ttl = self.settings.job_ttl_s
        pipe = self.redis.pipeline(transaction=True)  # all records or none
        created, index_entries = [], {}
        for request in requests:
            gid = group_id or new_id("group")
            blob = pack(request.model_copy(update={"n": 1}).model_dump(mode="json"))
            deadline_s = request.timeouts.job_s or self.settings.job_deadline_s
            job_ids = [new_id("job") for _ in range(request.n)]
            fields: dict[str, Any] = {
                "status": JobStatus.queued.value,
                "group_id": gid,
                "batch_id": batch_id,
                "created_at": now,
                "deadline_at": now + deadline_s,
                "domain": request.task["domain"],
                "metadata": json.dumps(request.metadata),
                "first_stage": first_stage(request, self.settings),
            }
            if fields["first_stage"] == "run" and request.agent.harness is None:
                fields["first_call_model"] = request.sampling.model or ""  # what init records for the others
            for index, job_id in enumerate(job_ids):
                seq += 1
                pipe.hset(self.key(job_id), mapping={"rollout_index": index, **fields})
                pipe.expire(self.key(job_id), ttl)
                pipe.set(self.key(job_id, "request"), blob, ex=ttl)
                index_entries[job_id] = seq
            pipe.rpush(f"{PREFIX}:group:{gid}", *job_ids)
            pipe.expire(f"{PREFIX}:group:{gid}", ttl)
            created.append((job_ids, gid))
        pipe.sadd(LIVE_JOBS, *index_entries)
        pipe.zadd(JOB_INDEX, index_entries)
        self._execute(pipe)
        return created

    def claim_idempotency_key(self, key: str, wait_s: float = 10.0) -> dict[str, Any] | None:
        """None if this request now owns ``key``; else the response stored by the one that does."""
        name = f"{PREFIX}:idem:{key}"
        if self._call(self.redis.set, name, "", nx=True, ex=self.settings.job_ttl_s):
            return None
        deadline = time.monotonic() + wait_s
        while not (stored := self.redis.get(name)):
            if time.monotonic() > deadline:
                raise Conflict(f"a request with Idempotency-Key {key!r} is still being processed; retry shortly")
            time.sleep(0.01)
        return json.loads(stored)

    def record_idempotent_response(self, key: str, response: dict[str, Any]) -> None:
        self._call(self.redis.set, f"{PREFIX}:idem:{key}", json.dumps(response), ex=self.settings.job_ttl_s)

    def group_jobs(self, group_id: str) -> list[str]:
        return [j.decode() for j in self.redis.lrange(f"{PREFIX}:group:{group_id}", 0, -1)]

    # -- reading ----------------------------------------------------------------------
    def fields(self, job_id: str) -> dict[str, str]:
        raw = self._call(self.redis.hgetall, self.key(job_id))
        if not raw:
            raise NotFound(f"no job {job_id!r}: it never existed or its TTL expired")
        return {k.decode(): v.decode() for k, v in raw.items()}

    def status(self, job_id: str) -> JobStatus:
        value = self._call(self.redis.hget, self.key(job_id), "status")
        if value is None:
            raise NotFound(f"no job {job_id!r}: it never existed or its TTL expired")
        return JobStatus(value.decode())

    def view(self, job_id: str) -> JobView:
        return self.views([job_id])[0]

    def views(self, job_ids: list[str]) -> list[JobView]:
        """Job views in one round trip (fields and result blobs pipelined); 404 naming unknown ids."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hmget(self.key(job_id), VIEW_FIELDS)
            pipe.get(self.key(job_id, "result"))
        replies = self._execute(pipe)
        rows = [dict(zip(VIEW_FIELDS, (None if v is None else v.decode() for v in values))) for values in replies[0::2]]
        missing = [j for j, row in zip(job_ids, rows) if row["status"] is None]
        if missing:
            raise NotFound(f"no job {_names(missing)}: never existed or TTL expired")
        return [
            _job_view(job_id, row, None if blob is None else unpack(blob))
            for job_id, row, blob in zip(job_ids, rows, replies[1::2])
        ]

    def statuses(self, job_ids: list[str]) -> list[str | None]:
        """Every job's status (None: no such job) in one pipelined round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hget(self.key(job_id), "status")
        return [None if v is None else v.decode() for v in self._execute(pipe)]

    def missing_and_ended(self, job_ids: list[str]) -> tuple[list[str], list[str]]:
        """The jobs that do not exist and those in a terminal status. A job in the live set has not
        ended (its terminal move takes it out): one SMISMEMBER answers for those, and only the
        others' statuses are read (usually few: a wait on thousands of jobs costs one command)."""
        if not job_ids:
            return [], []
        live = self._call(self.redis.smismember, LIVE_JOBS, job_ids)
        others = [job_id for job_id, member in zip(job_ids, live) if not member]
        if not others:
            return [], []
        statuses = self.statuses(others)
        terminal = {status.value for status in TERMINAL_STATUSES}
        return (
            [job_id for job_id, status in zip(others, statuses) if status is None],
            [job_id for job_id, status in zip(others, statuses) if status in terminal],
        )

    def list_jobs(
        self,
        status: JobStatus | None = None,
        group_id: str | None = None,
        batch_id: str | None = None,
        limit: int = 100,
        cursor: int | None = None,
        scan_cap: int = 20000,
    ) -> tuple[list[JobView], int | None]:
        """Newest first from the creation index; the cursor is the sequence number to continue below.
        Index entries whose job expired are trimmed on the way. At most ``scan_cap`` entries are
        examined per call: a filtered page may then be short with a cursor to go on."""
        wanted = {"status": status.value if status else None, "group_id": group_id, "batch_id": batch_id}
        if group_id:  # a group lists its own members: no need to walk the index
            return self._list_group(group_id, wanted, limit, cursor)
        found: list[str] = []
        upper = "+inf" if cursor is None else f"({cursor}"
        scanned = 0
        last_seq: int | None = None
        while len(found) < limit and scanned < scan_cap:
            chunk = self._call(
                self.redis.zrevrangebyscore,
                JOB_INDEX,
                upper,
                "-inf",
                start=0,
                num=min(500, scan_cap - scanned),
                withscores=True,
            )
            if not chunk:
                return self.views(found), None
            pipe = self.redis.pipeline(transaction=False)
            for member, _ in chunk:
                pipe.hmget(self.key(member.decode()), "status", "group_id", "batch_id")
            expired = []
            for (member, score), values in zip(chunk, self._execute(pipe)):
                scanned += 1
                last_seq = int(score)
                row = dict(zip(wanted, (None if v is None else v.decode() for v in values)))
                if row["status"] is None:
                    expired.append(member)
                elif all(want is None or row[name] == want for name, want in wanted.items()):
                    found.append(member.decode())
                    if len(found) == limit:
                        break
            if expired:
                self._call(self.redis.zrem, JOB_INDEX, *expired)
            upper = f"({last_seq}"
        return self.views(found), last_seq

    def _list_group(
        self, group_id: str, wanted: dict[str, str | None], limit: int, cursor: int | None
    ) -> tuple[list[JobView], int | None]:
        members = self.group_jobs(group_id)
        if not members:
            return [], None
        scores = self._call(self.redis.zmscore, JOB_INDEX, members)
        ranked = sorted(
            ((int(sc), j) for j, sc in zip(members, scores) if sc is not None and (cursor is None or sc < cursor)),
            reverse=True,
        )
        pipe = self.redis.pipeline(transaction=False)
        for _, job_id in ranked:
            pipe.hmget(self.key(job_id), "status", "batch_id")
        found: list[tuple[int, str]] = []
        for (seq, job_id), (job_status, job_batch) in zip(ranked, self._execute(pipe)):
            if job_status is None or wanted["status"] not in (None, job_status.decode()):
                continue
            if wanted["batch_id"] not in (None, as_text(job_batch or b"")):
                continue
            found.append((seq, job_id))
        page = found[:limit]
        more = len(found) > limit
        return self.views([j for _, j in page]), page[-1][0] if more else None

    def trim_job_index(self, batch: int = 1000) -> int:
        """Drop the oldest index entries whose job expired (housekeeping); returns how many."""
        oldest = self._call(self.redis.zrange, JOB_INDEX, 0, batch - 1)
        if not oldest:
            return 0
        pipe = self.redis.pipeline(transaction=False)
        for member in oldest:
            pipe.exists(self.key(member.decode()))
        gone = [m for m, alive in zip(oldest, self._execute(pipe)) if not alive]
        if gone:
            self._call(self.redis.zrem, JOB_INDEX, *gone)
        return len(gone)

    def raw_trajectories(self, job_ids: list[str]) -> list[bytes | None]:
        """The stored msgpack trajectory blobs, one MGET; 404 naming ids that are not jobs."""
        blobs = self._call(self.redis.mget, [self.key(j, "trajectory") for j in job_ids])
        unsure = [j for j, blob in zip(job_ids, blobs) if blob is None]
        if unsure:
            missing = [j for j, s in zip(unsure, self.statuses(unsure)) if s is None]
            if missing:
                raise NotFound(f"no job {_names(missing)}: never existed or TTL expired")
        return blobs

    # -- blobs --------------------------------------------------------------------------
    def put_blob(self, job_id: str, name: str, obj: Any) -> None:
        self._call(self.redis.set, self.key(job_id, name), pack(obj), ex=self.settings.job_ttl_s)

    def get_blob(self, job_id: str, name: str, default: Any = ...) -> Any:
        data = self._call(self.redis.get, self.key(job_id, name))
        if data is None:
            if default is ...:
                raise NotFound(f"job {job_id!r} has no {name} (yet): check its status first")
            return default
        return unpack(data)

    def put_trajectory(self, job_id: str, trajectory: Trajectory) -> None:
        self.put_blob(job_id, "trajectory", trajectory.model_dump(mode="json"))

    def trajectory(self, job_id: str) -> Trajectory:
        return Trajectory.model_validate(self.get_blob(job_id, "trajectory"))

    # -- state changes ----------------------------------------------------------------
    def transition(self, job_id: str, to: JobStatus, allowed_from: Iterable[JobStatus] = (), **fields: Any) -> bool:
        """Move a non-terminal job to ``to`` (if its status is in ``allowed_from``, when given)."""
        return self._move(job_id, to, allowed_from, fields) is not None

    def _move(
        self, job_id: str, to: JobStatus, allowed_from: Iterable[JobStatus], fields: dict[str, Any]
    ) -> dict[str, str] | None:
        """``transition``; None if the job did not move, else its fields after a terminal move
        (read once, for the metrics and the finish hooks), or {} after any other move."""
        keys, args = self._transition_call(job_id, to, allowed_from, fields)
        return self._moved(job_id, self._call(self._transition, keys=keys, args=args), announce=False)

    def _transition_call(
        self, job_id: str, to: JobStatus, allowed_from: Iterable[JobStatus], fields: dict[str, Any]
    ) -> tuple[list[str], list[Any]]:
        args: list[Any] = [
            to.value,
            ",".join(s.value for s in allowed_from),
            "1" if to in TERMINAL_STATUSES else "0",
            job_id,
        ]
        for name, value in fields.items():
            args += [name, "" if value is None else value]
        return [self.key(job_id), LIVE_JOBS, FINISHED_CHANNEL], args

    def _moved(self, job_id: str, result: Any, announce: bool) -> dict[str, str] | None:
        """What the transition script answered: None (no move), {} (a move), or the job's fields
        after a terminal move, then recorded in the metrics and, when ``announce``, told to the
        finish hooks."""
        if result == -1:
            raise NotFound(f"no job {job_id!r}: it never existed or its TTL expired")
        ended = self._moved_fields(result)
        if ended is None:
            return {} if result == 1 else None
        self._ended({job_id: ended}, announce)
        return ended

    def _ended(self, ended: dict[str, dict[str, str]], announce: bool, finished: Increments | None = None) -> None:
        if not ended:
            return
        if finished is None:
            record_job_finished(self.redis, *ended.values())
        else:
            count_jobs_finished(finished, *ended.values())
        if announce:
            for job_id, fields in ended.items():
                for hook in self.on_finished:
                    hook(job_id, fields.get("batch_id", ""))

    @staticmethod
    def finish_fields(error: Exception | ErrorInfo | None = None, **fields: Any) -> dict[str, Any]:
        if error is not None:
            info = (
                error
                if isinstance(error, ErrorInfo)
                else ErrorInfo(
                    code=getattr(error, "code", "internal_error"), message=str(error) or type(error).__name__
                )
            )
            fields.update(error_code=info.code, error_message=info.message)
        fields.setdefault("finished_at", time.time())
        return fields

    def finish(
        self,
        job_id: str,
        status: JobStatus,
        error: Exception | ErrorInfo | None = None,
        allowed_from: Iterable[JobStatus] = (),
        **fields: Any,
    ) -> bool:
        keys, args = self._transition_call(job_id, status, allowed_from, self.finish_fields(error, **fields))
        return self._moved(job_id, self._call(self._transition, keys=keys, args=args), announce=True) is not None

    def set_fields(self, job_id: str, **fields: Any) -> None:
        self._call(self.redis.hset, self.key(job_id), mapping={k: "" if v is None else v for k, v in fields.items()})

    def request_cancel(self, job_id: str) -> None:
        """Raise the job's cancel flag and tell the run workers (``llm.CancelWatcher``) at once."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(self.key(job_id), "cancel_requested", "1")
        pipe.publish(CANCEL_CHANNEL, job_id)
        self._execute(pipe)

    def cancel(self, job_id: str, announce: bool = True) -> bool:
        """Cooperative cancel: raise the job's flag (its next turn or stage start ends it) and end
        it here if it is still queued; True if it ended here. ``announce=False`` ends it without
        the batch event (for a batch cancelling its own jobs)."""
        if self.status(job_id) in TERMINAL_STATUSES:
            return False
        self.request_cancel(job_id)
        fields = {"finish_reason": "cancelled", "finished_at": time.time()}
        if announce:
            return self.finish(job_id, JobStatus.cancelled, allowed_from=(JobStatus.queued,), **fields)
        return self.transition(job_id, JobStatus.cancelled, (JobStatus.queued,), **fields)

    def cancel_requested(self, job_id: str) -> bool:
        return self._call(self.redis.hget, self.key(job_id), "cancel_requested") == b"1"

    def live_jobs(self) -> set[str]:
        return {j.decode() for j in self.redis.smembers(LIVE_JOBS)}

    # -- stages: one round trip in, one out ---------------------------------------------
    def begin_stages(
        self,
        job_ids: list[str],
        stage: str,
        previous: JobStatus,
        status: JobStatus,
        owner: str,
        reads: tuple[str, ...] = (),
        skipping: tuple[JobStatus, str] | None = None,
        calls: dict[str, BeginCall] | None = None,
    ) -> list[tuple[str, list[str], dict[str, bytes | None]]]:
        """For each job: check it may enter ``stage``, take its lease, count the delivery and set its
        status: ``("ok", [deadline_at, attempts, rollout_index], blobs)``, or ``("skip", [status])``,
        ``("cancelled", [])``, ``("leased", [])``, ``("missing", [])``; ``blobs`` holds the packed
        blobs named in ``reads``. ``skipping``: (status, field) — a job in that status may enter too
        (it skipped the stage before), and the field is stamped with the begin. ``calls``: per job,
        a script that begins the stage the same way and does more in the same call (``BeginCall``).
        One round trip for all the jobs."""
        also_from, stamp = skipping or (None, "")
        args = [
            previous.value,
            status.value,
            owner,
            int(self.settings.lease_ttl_s * 1000),
            f"attempts_{stage}",
            f"{stage}_start",
            time.time(),
            f"{stage}_end",
            also_from.value if also_from else "",
            stamp,
        ]
        calls = calls or {}
        pipe = self.redis.pipeline(transaction=False)  # in a green worker: part of the shared round trip
        for job_id in job_ids:
            keys = [self.key(job_id), self.key(job_id, "lease")]
            call = calls.get(job_id)
            if call is None:
                self._begin_stage(keys=keys, args=args, client=pipe)
            else:
                call.script(keys=keys, args=[*args, *call.args], client=pipe)
            if reads:
                pipe.mget([self.key(job_id, name) for name in reads])
        replies = self._execute(pipe)
        step = 2 if reads else 1
        begun = []
        for n, (job_id, reply) in enumerate(zip(job_ids, replies[::step])):
            if job_id in calls:
                reply, answer = reply
                calls[job_id].answered(answer)
            begun.append(
                (
                    as_text(reply[0]),
                    [as_text(v) for v in reply[1:]],
                    dict(zip(reads, replies[n * step + 1])) if reads else {},
                )
            )
        return begun

    def end_stages(self, ends: list[StageEnd], finished: Increments | None = None) -> list[JobStatus | None]:
        """For each job: store its blobs, make its terminal move if it has one, release its lease and
        set its fields; the jobs' statuses after their stage. One round trip for all of them (the
        finished jobs' metrics are one more, or go into ``finished`` for the caller to write)."""
        if not ends:
            return []
        pipe = self.redis.pipeline(transaction=False)  # in a green worker: part of the shared round trip
        positions, at = [], 0
        for end in ends:
            for name, obj in end.blobs.items():
                pipe.set(
                    self.key(end.job_id, name),
                    obj if isinstance(obj, Packed) else pack(obj),
                    ex=self.settings.job_ttl_s,
                )
            fields = [part for name, value in end.fields.items() for part in (name, "" if value is None else value)]
            lease = self.key(end.job_id, "lease")
            if end.finish is None:
                self._end_stage(keys=[self.key(end.job_id), lease], args=[end.owner, *fields], client=pipe)
            else:
                keys, args = self._transition_call(end.job_id, end.finish[0], (), self.finish_fields(**end.finish[1]))
                self._move_and_end_stage(
                    keys=[*keys, lease], args=[end.owner, len(fields), *fields, *args, *fields], client=pipe
                )
            at += len(end.blobs)
            positions.append(at)  # the end script's reply follows the job's SETs
            at += 1
        answers = self._execute(pipe)
        replies = [answers[at] for at in positions]
        moved = {end.job_id: reply[0] for end, reply in zip(ends, replies) if end.finish is not None}
        self._ended(
            {job_id: ended for job_id, result in moved.items() if (ended := self._moved_fields(result)) is not None},
            announce=True,
            finished=finished,
        )
        statuses = [reply[1] if end.finish is not None else reply for end, reply in zip(ends, replies)]
        return [None if status is None else JobStatus(as_text(status)) for status in statuses]

    @staticmethod
    def _moved_fields(result: Any) -> dict[str, str] | None:
        """The job's fields a terminal move answers with (None: the script did not make one)."""
        if not isinstance(result, list):
            return None
        return {name: as_text(value) for name, value in zip(ENDED_FIELDS, result) if value is not None}

    def renew_leases(self, owners: dict[str, str]) -> None:
        """Renew many leases (job id -> owner) in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        ttl_ms = int(self.settings.lease_ttl_s * 1000)
        for job_id, owner in owners.items():
            self._renew_lease(keys=[self.key(job_id, "lease")], args=[owner, ttl_ms], client=pipe)
        self._execute(pipe)

    def pop_within(self, key: str, timeout_s: float, block_s: float = 1.0) -> bytes | None:
        """BLPOP ``key`` for up to ``timeout_s``, in blocks of ``block_s`` (each under the socket timeout)."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            answer = self._call(self.redis.blpop, [key], timeout=max(min(left, block_s), 0.01))
            if answer is not None:
                return answer[1]
        return None

    # -- plumbing ---------------------------------------------------------------------
    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except TRANSIENT_REDIS_ERRORS as exc:
            raise StoreUnavailable(
                f"Redis is unreachable or not answering ({type(exc).__name__}: {exc}); "
                "check ROLLOUT_REDIS_URL and that Redis runs, then retry"
            ) from exc

    def _execute(self, pipe: redis.client.Pipeline) -> list[Any]:
        return self._call(pipe.execute)


def _job_view(job_id: str, f: dict[str, str | None], result: Any) -> JobView:
    t = {
        k: _float(f.get(k))
        for k in ("created_at", "init_start", "init_end", "run_start", "run_end", "eval_start", "eval_end")
    }
    waits = {
        "init": (t["created_at"], t["init_start"]),
        "run": (t["init_end"], t["run_start"]),
        "eval": (t["run_end"], t["eval_start"]),
    }
    queued = {stage: b - a for stage, (a, b) in waits.items() if a is not None and b is not None}
    timings = Timings(
        queued_s=sum(queued.values()) if queued else None,
        waits_s=queued,
        init_s=_span(t["init_start"], t["init_end"]),
        run_s=_span(t["run_start"], t["run_end"]),
        eval_s=_span(t["eval_start"], t["eval_end"]),
        sandbox_boot_s=_float(f.get("sandbox_boot_s")),
        sandbox_wait_s=_float(f.get("sandbox_wait_s")),
    )
    error = ErrorInfo(code=f["error_code"], message=f.get("error_message") or "") if f.get("error_code") else None
    return JobView(
        job_id=job_id,
        status=JobStatus(f["status"]),
        group_id=f["group_id"] or "",
        timings=timings,
        reward=_float(f.get("reward")),
        finish_reason=f.get("finish_reason") or None,
        error=error,
        result=result,
        backend_id=f.get("backend_id") or None,
        attempts=max(int(f.get(f"attempts_{s}") or 0) for s in STAGES),
        metadata=json.loads(f.get("metadata") or "{}"),
    )


def _names(job_ids: list[str], shown: int = 20) -> str:
    more = f" and {len(job_ids) - shown} more" if len(job_ids) > shown else ""
    return ", ".join(repr(j) for j in job_ids[:shown]) + more


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


def workspace_dir(settings: Settings, job_id: str) -> Path:
    return settings.workspaces_path / job_id
