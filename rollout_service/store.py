"""Job state in Redis: one hash per job, msgpack blobs beside it, all with a TTL.

Status changes go through one Lua script so a job reaches exactly one terminal state,
whatever redeliveries, cancels and deadlines race for it.
"""
from __future__ import annotations

import functools
import json
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import msgpack
import redis

from rollout_service.errors import ConfigError, Conflict, NotFound, StoreUnavailable
from rollout_service.metrics_recording import record_job_finished
from rollout_service.schemas import (
    TERMINAL_STATUSES, ErrorInfo, JobRequest, JobStatus, JobView, Timings, Trajectory,
)
from rollout_service.settings import Settings, get_settings

PREFIX = "rollout"
LIVE_JOBS = f"{PREFIX}:jobs:live"
STAGES = ("init", "run", "eval")
BATCH_MEMBER_DONE_TASK = "workers.control.batch_member_done"

_TRANSITION = """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return -1 end
if cur == 'completed' or cur == 'failed' or cur == 'cancelled' or cur == 'timed_out' then return 0 end
if ARGV[2] ~= '' then
  local ok = false
  for s in string.gmatch(ARGV[2], '[^,]+') do if s == cur then ok = true end end
  if not ok then return 0 end
end
redis.call('HSET', KEYS[1], 'status', ARGV[1])
for i = 5, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
if ARGV[3] == '1' then redis.call('SREM', KEYS[2], ARGV[4]) end
return 1
"""

_RELEASE_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

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
def _client_for(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, health_check_interval=30, socket_keepalive=True)


def redis_client(settings: Settings | None = None) -> redis.Redis:
    return _client_for(resolve_redis_url(settings or get_settings()))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def as_text(value: Any) -> str:
    """A Redis reply (bytes) or a plain value as str."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _float(value: Optional[str]) -> Optional[float]:
    return float(value) if value else None


class JobStore:
    def __init__(self, client: redis.Redis, settings: Settings | None = None) -> None:
        self.redis = client
        self.settings = settings or get_settings()
        self._transition = client.register_script(_TRANSITION)
        self._release_lease = client.register_script(_RELEASE_LEASE)
        self._renew_lease = client.register_script(_RENEW_LEASE)

    @staticmethod
    def key(job_id: str, part: str = "") -> str:
        return f"{PREFIX}:job:{job_id}" + (f":{part}" if part else "")

    # -- submission -------------------------------------------------------------------
    def create_jobs(self, request: JobRequest, group_id: str | None = None,
                    batch_id: str = "") -> tuple[list[str], str]:
        group_id = group_id or new_id("group")
        single = request.model_copy(update={"n": 1})
        blob = pack(single.model_dump(mode="json"))
        now = time.time()
        deadline_s = request.timeouts.job_s or self.settings.job_deadline_s
        ttl = self.settings.job_ttl_s
        job_ids = [new_id("job") for _ in range(request.n)]
        pipe = self.redis.pipeline(transaction=True)
        for index, job_id in enumerate(job_ids):
            pipe.hset(self.key(job_id), mapping={
                "rollout_index": index,
                "status": JobStatus.queued.value, "group_id": group_id, "batch_id": batch_id,
                "created_at": now, "deadline_at": now + deadline_s,
                "domain": request.task["domain"],
                "metadata": json.dumps(request.metadata),
            })
            pipe.expire(self.key(job_id), ttl)
            pipe.set(self.key(job_id, "request"), blob, ex=ttl)
            pipe.sadd(LIVE_JOBS, job_id)
        pipe.rpush(f"{PREFIX}:group:{group_id}", *job_ids)
        pipe.expire(f"{PREFIX}:group:{group_id}", ttl)
        self._execute(pipe)
        return job_ids, group_id

    def claim_idempotency_key(self, key: str, wait_s: float = 10.0) -> Optional[dict[str, Any]]:
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

    def request(self, job_id: str) -> JobRequest:
        return JobRequest.model_validate(self.get_blob(job_id, "request"))

    def view(self, job_id: str) -> JobView:
        f = self.fields(job_id)
        t = {k: _float(f.get(k)) for k in (
            "created_at", "init_start", "init_end", "run_start", "run_end", "eval_start", "eval_end")}
        waits = [(t["created_at"], t["init_start"]), (t["init_end"], t["run_start"]),
                 (t["run_end"], t["eval_start"])]
        queued = [b - a for a, b in waits if a is not None and b is not None]
        timings = Timings(
            queued_s=sum(queued) if queued else None,
            init_s=_span(t["init_start"], t["init_end"]),
            run_s=_span(t["run_start"], t["run_end"]),
            eval_s=_span(t["eval_start"], t["eval_end"]),
            sandbox_boot_s=_float(f.get("sandbox_boot_s")),
        )
        error = ErrorInfo(code=f["error_code"], message=f.get("error_message", "")) \
            if f.get("error_code") else None
        result = self.get_blob(job_id, "result", default=None)
        return JobView(
            job_id=job_id, status=JobStatus(f["status"]), group_id=f["group_id"],
            timings=timings, reward=_float(f.get("reward")),
            finish_reason=f.get("finish_reason") or None, error=error, result=result,
            backend_id=f.get("backend_id") or None,
            attempts=max(int(f.get(f"attempts_{s}", 0)) for s in STAGES),
            metadata=json.loads(f.get("metadata", "{}")),
        )

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
    def transition(self, job_id: str, to: JobStatus, allowed_from: Iterable[JobStatus] = (),
                   **fields: Any) -> bool:
        """Move a non-terminal job to ``to`` (if its status is in ``allowed_from``, when given)."""
        args: list[Any] = [to.value, ",".join(s.value for s in allowed_from),
                           "1" if to in TERMINAL_STATUSES else "0", job_id]
        for name, value in fields.items():
            args += [name, "" if value is None else value]
        result = self._call(self._transition, keys=[self.key(job_id), LIVE_JOBS], args=args)
        if result == -1:
            raise NotFound(f"no job {job_id!r}: it never existed or its TTL expired")
        if result == 1 and to in TERMINAL_STATUSES:
            record_job_finished(self.redis, self.fields(job_id))
        return result == 1

    def finish(self, job_id: str, status: JobStatus, error: Optional[Exception | ErrorInfo] = None,
               allowed_from: Iterable[JobStatus] = (), **fields: Any) -> bool:
        if error is not None:
            info = error if isinstance(error, ErrorInfo) else ErrorInfo(
                code=getattr(error, "code", "internal_error"), message=str(error) or type(error).__name__)
            fields.update(error_code=info.code, error_message=info.message)
        fields.setdefault("finished_at", time.time())
        ended = self.transition(job_id, status, allowed_from, **fields)
        if ended and self.redis.hget(self.key(job_id), "batch_id"):
            from workers.celery_app import app

            app.send_task(BATCH_MEMBER_DONE_TASK, args=(job_id,), queue="control")
        return ended

    def set_fields(self, job_id: str, **fields: Any) -> None:
        self._call(self.redis.hset, self.key(job_id), mapping={k: "" if v is None else v for k, v in fields.items()})

    def count_attempt(self, job_id: str, stage: str) -> int:
        return int(self._call(self.redis.hincrby, self.key(job_id), f"attempts_{stage}", 1))

    def request_cancel(self, job_id: str) -> None:
        self.set_fields(job_id, cancel_requested="1")

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

    def deadline_at(self, job_id: str) -> float:
        return float(self.fields(job_id)["deadline_at"])

    def live_jobs(self) -> set[str]:
        return {j.decode() for j in self.redis.smembers(LIVE_JOBS)}

    # -- leases: one live runner per job ------------------------------------------------
    def acquire_lease(self, job_id: str, owner: str) -> bool:
        return bool(self.redis.set(self.key(job_id, "lease"), owner, nx=True,
                                   px=int(self.settings.lease_ttl_s * 1000)))

    def renew_lease(self, job_id: str, owner: str) -> bool:
        return bool(self._renew_lease(keys=[self.key(job_id, "lease")],
                                      args=[owner, int(self.settings.lease_ttl_s * 1000)]))

    def release_lease(self, job_id: str, owner: str) -> None:
        self._release_lease(keys=[self.key(job_id, "lease")], args=[owner])

    # -- plumbing ---------------------------------------------------------------------
    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except redis.ConnectionError as exc:
            raise StoreUnavailable(f"Redis is unreachable ({exc}); check ROLLOUT_REDIS_URL and that Redis runs") from exc

    def _execute(self, pipe: redis.client.Pipeline) -> list[Any]:
        return self._call(pipe.execute)


def _span(start: Optional[float], end: Optional[float]) -> Optional[float]:
    return None if start is None or end is None else end - start


def workspace_dir(settings: Settings, job_id: str) -> Path:
    return settings.state_path / "workspaces" / job_id
