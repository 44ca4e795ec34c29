"""Job state in Redis: one hash per job, msgpack blobs beside it, all with a TTL. Status changes go
through the scripts of ``job_scripts``; the callers' ``on_finished`` hooks hear of every job that
reached a terminal state here."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

import redis
from redis.commands.core import Script

from rollout_service.errors import Conflict, NotFound
from rollout_service.schemas import TERMINAL_STATUSES, ErrorInfo, JobRequest, JobStatus, Trajectory
from rollout_service.settings import Settings
from rollout_service.state.codec import Packed, pack
from rollout_service.state.connection import as_text, scripts_of
from rollout_service.state.job_scripts import (
    BEGIN_STAGE,
    END_STAGE,
    ENDED_FIELDS,
    HAND_BACK,
    MOVE_AND_END_STAGE,
    RENEW_LEASE,
    TRANSITION,
)
from rollout_service.state.keys import (
    CANCEL_CHANNEL,
    FINISHED_CHANNEL,
    JOB_INDEX,
    JOB_SEQUENCE,
    LIVE_JOBS,
    group_key,
    idempotency_key,
    new_id,
    recovery_field,
)
from rollout_service.state.metrics_recording import Increments, count_jobs_finished, record_job_finished
from rollout_service.state.reading import JobReader
from rollout_service.tasks import first_stage

# a claim whose request died (its gateway killed) lapses after this, gunicorn's timeout; a response stays job_ttl_s
IDEMPOTENCY_CLAIM_S = 120
OnFinished = Callable[[str, str], None]  # (job id, batch id or "") once a job reached a terminal state


@dataclass
class StageEnd:
    """What ends a job's stage, in this order: blobs stored, a terminal move (status, its fields and
    ``fields``) or else ``fields`` set, the lease released."""

    job_id: str
    owner: str
    fields: dict[str, Any] = dataclass_field(default_factory=dict)
    blobs: dict[str, Any] = dataclass_field(default_factory=dict)
    finish: tuple[JobStatus, dict[str, Any]] | None = None
    call: EndCall | None = None  # what the end also does, in the same script call


@dataclass
class BeginCall:
    """A script a job's stage begins with instead of the plain begin: it starts with
    ``BEGIN_STAGE_FUNCTION``, reads ``args`` after the begin's ARGV and answers ``{begin_stage()'s
    answer, its own}``; ``answered`` takes its own answer."""

    script: Script
    args: list[Any]
    answered: Callable[[Any], None]


@dataclass
class EndCall:
    """The scripts a job's stage ends with instead of the plain ones (``job_scripts.stage_end_scripts``
    with more Lua after the end), and the ARGV that Lua reads after the end's own."""

    end: Script
    move_and_end: Script
    args: list[Any]


class JobStore(JobReader):
    def __init__(
        self, client: redis.Redis, settings: Settings | None = None, on_finished: Sequence[OnFinished] = ()
    ) -> None:
        """``on_finished``: told of each job this store ends with ``finish``, ``cancel`` or ``end_stages``
        (the workers' and the gateway's stores announce a batch member's end with it)."""
        super().__init__(client, settings)
        self.on_finished = list(on_finished)
        (
            self._transition,
            self._renew_lease,
            self._begin_stage,
            self._end_stage,
            self._move_and_end_stage,
            self._hand_back,
        ) = scripts_of(client, TRANSITION, RENEW_LEASE, BEGIN_STAGE, END_STAGE, MOVE_AND_END_STAGE, HAND_BACK)

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
            pipe.rpush(group_key(gid), *job_ids)
            pipe.expire(group_key(gid), ttl)
            created.append((job_ids, gid))
        pipe.sadd(LIVE_JOBS, *index_entries)
        pipe.zadd(JOB_INDEX, index_entries)
        self._execute(pipe)
        return created

    def claim_idempotency_key(self, key: str, wait_s: float = 10.0) -> dict[str, Any] | None:
        """None if this request now owns ``key``; else the response stored by the one that does."""
        name = idempotency_key(key)
        if self._call(self.redis.set, name, "", nx=True, ex=IDEMPOTENCY_CLAIM_S):
            return None
        deadline = time.monotonic() + wait_s
        while not (stored := self._call(self.redis.get, name)):
            if time.monotonic() > deadline:
                raise Conflict(f"a request with Idempotency-Key {key!r} is still being processed; retry shortly")
            time.sleep(0.01)
        return json.loads(stored)

    def release_idempotency_key(self, key: str) -> None:
        """Give up a claim whose request failed before it had a response to record."""
        name = idempotency_key(key)
        if self._call(self.redis.get, name) == b"":
            self._call(self.redis.delete, name)

    def record_idempotent_response(self, key: str, response: dict[str, Any]) -> None:
        self._call(self.redis.set, idempotency_key(key), json.dumps(response), ex=self.settings.job_ttl_s)

    # -- blobs --------------------------------------------------------------------------
    def put_blob(self, job_id: str, name: str, obj: Any) -> None:
        self._call(self.redis.set, self.key(job_id, name), pack(obj), ex=self.settings.job_ttl_s)

    def put_trajectory(self, job_id: str, trajectory: Trajectory) -> None:
        self.put_blob(job_id, "trajectory", trajectory.model_dump(mode="json"))

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
        fields: dict[str, Any] = {"finish_reason": "cancelled", "finished_at": time.time()}
        if announce:
            return self.finish(job_id, JobStatus.cancelled, allowed_from=(JobStatus.queued,), **fields)
        return self.transition(job_id, JobStatus.cancelled, (JobStatus.queued,), **fields)

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
        ``("cancelled", [])``, ``("leased", [])`` (another delivery holds it, or began it and was
        not found lost: ``hand_back``), ``("missing", [])``; ``blobs`` holds the packed
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
            recovery_field(stage),
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
            end_stage, move_and_end = (
                (end.call.end, end.call.move_and_end) if end.call else (self._end_stage, self._move_and_end_stage)
            )
            then = end.call.args if end.call else []
            if end.finish is None:
                end_stage(keys=[self.key(end.job_id), lease], args=[end.owner, *fields, *then], client=pipe)
            else:
                keys, args = self._transition_call(end.job_id, end.finish[0], (), self.finish_fields(**end.finish[1]))
                move_and_end(
                    keys=[*keys, lease], args=[end.owner, len(fields), *fields, *args, *fields, *then], client=pipe
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

    def renew_leases(self, held: dict[str, tuple[str, str, JobStatus]]) -> list[str]:
        """Renew many leases (job id -> (owner, stage, its status)) in one round trip, taking again those that
        lapsed while their stage is still the job's (a Redis restart); the jobs whose lease another
        delivery holds now, or whose stage is over."""
        pipe = self.redis.pipeline(transaction=False)
        ttl_ms = int(self.settings.lease_ttl_s * 1000)
        for job_id, (owner, stage, status) in held.items():
            self._renew_lease(
                keys=[self.key(job_id, "lease"), self.key(job_id)],
                args=[owner, ttl_ms, status.value, f"{stage}_end"],
                client=pipe,
            )
        return [job_id for job_id, renewed in zip(held, self._execute(pipe)) if not renewed]

    def hand_back(self, job_id: str, stage: str, owner: str, attempt: int) -> None:
        """Give up this delivery (``attempt``) of the job's begun ``stage``: the next delivery takes
        it over (``begin_stages``); the caller sends one."""
        self._call(
            self._hand_back,
            keys=[self.key(job_id), self.key(job_id, "lease")],
            args=[owner, recovery_field(stage), attempt],
        )

    def pop_within(self, key: str, timeout_s: float, block_s: float = 1.0) -> bytes | None:
        """BLPOP ``key`` for up to ``timeout_s``, in blocks of ``block_s`` (each under the socket timeout)."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            answer = self._call(self.redis.blpop, [key], timeout=max(min(left, block_s), 0.01))
            if answer is not None:
                return answer[1]
        return None
