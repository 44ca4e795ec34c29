"""Reading jobs: fields, statuses, views, listings and blobs, most of them one round trip for many jobs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import redis

from rollout_service.errors import NotFound
from rollout_service.schemas import TERMINAL_STATUSES, JobStatus, JobView, Trajectory
from rollout_service.settings import Settings, get_settings
from rollout_service.state.codec import unpack
from rollout_service.state.connection import as_text, call_redis
from rollout_service.state.keys import JOB_INDEX, LIVE_JOBS, group_key, job_key
from rollout_service.state.views import VIEW_FIELDS, job_names, job_view


class JobReader:
    """The reading half of ``JobStore``: one job's fields or status, many jobs' views or statuses in one
    round trip, listings from the creation index, stored blobs."""

    def __init__(self, client: redis.Redis, settings: Settings | None = None) -> None:
        self.redis = client
        self.settings = settings or get_settings()

    key = staticmethod(job_key)

    def group_jobs(self, group_id: str) -> list[str]:
        return [j.decode() for j in self._call(self.redis.lrange, group_key(group_id), 0, -1)]

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
            raise NotFound(f"no job {job_names(missing)}: never existed or TTL expired")
        return [
            job_view(job_id, row, None if blob is None else unpack(blob))
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
                pipe.hmget(self.key(member.decode()), ["status", "group_id", "batch_id"])
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
            pipe.hmget(self.key(job_id), ["status", "batch_id"])
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

    def trim_job_index(self, batch: int = 1000, probe: int = 16) -> int:
        """Drop the oldest index entries whose job expired (housekeeping); returns how many. Jobs
        expire in the order they were created, so while the ``probe`` oldest are all alive there
        is nothing to trim (one small look per sweep, not ``batch`` EXISTS)."""
        oldest = self._call(self.redis.zrange, JOB_INDEX, 0, batch - 1)
        gone = self._expired(oldest[:probe])
        if len(gone) == min(probe, len(oldest)) and len(oldest) > probe:
            gone += self._expired(oldest[probe:])
        if gone:
            self._call(self.redis.zrem, JOB_INDEX, *gone)
        return len(gone)

    def _expired(self, members: list[bytes]) -> list[bytes]:
        if not members:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for member in members:
            pipe.exists(self.key(member.decode()))
        return [m for m, alive in zip(members, self._execute(pipe)) if not alive]

    def raw_trajectories(self, job_ids: list[str]) -> list[bytes | None]:
        """The stored msgpack trajectory blobs, one MGET; 404 naming ids that are not jobs."""
        blobs = self._call(self.redis.mget, [self.key(j, "trajectory") for j in job_ids])
        unsure = [j for j, blob in zip(job_ids, blobs) if blob is None]
        if unsure:
            missing = [j for j, s in zip(unsure, self.statuses(unsure)) if s is None]
            if missing:
                raise NotFound(f"no job {job_names(missing)}: never existed or TTL expired")
        return blobs

    def get_blob(self, job_id: str, name: str, default: Any = ...) -> Any:
        data = self._call(self.redis.get, self.key(job_id, name))
        if data is None:
            if default is ...:
                raise NotFound(f"job {job_id!r} has no {name} (yet): check its status first")
            return default
        return unpack(data)

    def trajectory(self, job_id: str) -> Trajectory:
        return Trajectory.model_validate(self.get_blob(job_id, "trajectory"))

    def cancel_requested(self, job_id: str) -> bool:
        return self._call(self.redis.hget, self.key(job_id), "cancel_requested") == b"1"

    def live_jobs(self) -> set[str]:
        return {j.decode() for j in self._call(self.redis.smembers, LIVE_JOBS)}

    def are_live(self, job_ids: list[str]) -> list[bool]:
        """Whether each job is live (created and not ended), in one command."""
        if not job_ids:
            return []
        return [bool(member) for member in self._call(self.redis.smismember, LIVE_JOBS, job_ids)]

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return call_redis(fn, *args, **kwargs)

    def _execute(self, pipe: redis.client.Pipeline) -> list[Any]:
        return cast(list[Any], call_redis(pipe.execute))
