"""What every stage does around its body, per job: skip finished jobs, count redeliveries,
hold the job's lease, enforce the deadline, turn exceptions into a typed status, and hand a
job that goes on to the next stage.

A stage begins all the jobs of a message in one Redis round trip (``JobStore.begin_stages``) and
ends them in one (``end_stages``), or, in eval, each as soon as it is graded; the leases of all
jobs in a process are renewed together by one keeper thread. Tasks end SUCCESS in Celery's eyes
whatever happened to their jobs (a job's status is the record).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from celery.worker import state as worker_state

from rollout_service.errors import (
    STORE_OUTAGE,
    DeadlineExceeded,
    NotFound,
    RedeliveryLimit,
    RolloutError,
    SandboxError,
)
from rollout_service.schemas import TERMINAL_STATUSES, FinishReason, JobStatus
from rollout_service.settings import Settings, get_settings
from rollout_service.state.codec import unpack
from rollout_service.state.connection import redis_client
from rollout_service.state.metrics_recording import Increments
from rollout_service.state.store import BeginCall, EndCall, JobStore, StageEnd
from workers import dispatch

log = logging.getLogger(__name__)

STAGE_STATUS = {"init": JobStatus.initializing, "run": JobStatus.running, "eval": JobStatus.evaluating}
PREVIOUS_STATUS = {"init": JobStatus.queued, "run": JobStatus.initializing, "eval": JobStatus.running}
# a job of a domain that prepares cheaply skips init: run begins it from queued and stamps init_start
BEGINS_SKIPPING = {"run": (JobStatus.queued, "init_start")}
STAGE_READS = {"init": ("request",), "run": ("request", "prepared"), "eval": ("request", "artifact", "trajectory")}
Begun = tuple[str, list[str], dict[str, bytes | None]]  # JobStore.begin_stages, per job


class SkipStage(Exception):
    """The stage must not run (already done, cancelled, or another delivery holds the job)."""


@dataclass
class StageContext:
    job_id: str
    stage: str
    store: JobStore
    settings: Settings
    deadline_at: float
    attempt: int = 1
    rollout_index: int = 0
    blobs: dict[str, bytes | None] = field(default_factory=dict)
    results: dict[str, Any] = field(default_factory=dict)  # blobs stored with the stage's end
    finish_as: tuple[JobStatus, dict[str, Any]] | None = None  # a terminal move made with them
    end_fields: dict[str, Any] = field(default_factory=dict)  # job fields set with the stage's end
    end_call: EndCall | None = None  # what the stage's end also does, however the stage ended

    def remaining_s(self) -> float:
        return self.deadline_at - time.time()

    def blob(self, name: str) -> Any:
        """A blob the stage read when it began (STAGE_READS)."""
        return unpack(self.raw_blob(name))

    def raw_blob(self, name: str) -> bytes:
        """The same, still in msgpack."""
        data = self.blobs.get(name)
        if data is None:
            raise NotFound(f"job {self.job_id!r} has no {name} (yet): check its status first")
        return data


_stores: dict[int, JobStore] = {}


def job_store() -> JobStore:
    """This process's store for the current settings (a forked child makes its own)."""
    settings = get_settings()
    store = _stores.get(os.getpid())
    if store is None or store.settings is not settings:
        store = _stores[os.getpid()] = JobStore(
            redis_client(settings, ride_out_outages=True), settings, on_finished=[dispatch.announce_batch_member_done]
        )
    return store


class LeaseKeeper:
    """Renews the leases of every stage running in this process, all in one round trip; a lease
    that lapsed while Redis was away is taken again."""

    def __init__(self) -> None:
        self.held: dict[str, tuple[str, str, JobStatus]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid = 0

    def hold(self, job_id: str, owner: str, stage: str) -> None:
        with self._lock:
            self.held[job_id] = (owner, stage, STAGE_STATUS[stage])
            if self._thread is None or self._pid != os.getpid():
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._renew_forever, name="lease-keeper", daemon=True)
                self._thread.start()

    def drop(self, job_id: str) -> None:
        with self._lock:
            self.held.pop(job_id, None)

    def _renew_forever(self) -> None:
        store = job_store()
        while True:
            time.sleep(store.settings.lease_ttl_s / 3)
            with self._lock:
                held = dict(self.held)
            if held:
                try:
                    lost = store.renew_leases(held)
                except Exception:  # Redis is away: the next round tries again (and takes lapsed leases again)
                    log.warning("could not renew %d leases", len(held), exc_info=True)
                    continue
                for job_id in lost:
                    if job_id in self.held:
                        log.error("job %s: another delivery holds its stage now (this one was found lost)", job_id)


leases = LeaseKeeper()


def new_owner() -> str:
    return f"{_host()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@functools.cache
def _host() -> str:
    return socket.gethostname()


@contextlib.contextmanager
def stage(
    store: JobStore, job_id: str, name: str, begun: Begun, owner: str, ended: list[StageEnd]
) -> Iterator[StageContext]:
    """Run a stage body at most once at a time per job; end the job on any failure. ``begun`` is
    what ``JobStore.begin_stages`` answered for it; what ``end_stages`` must do is added to ``ended``."""
    settings = store.settings
    verdict, values, blobs = begun
    if verdict == "missing":
        raise SkipStage(f"job {job_id} does not exist (expired?); {name} has nothing to do")
    if verdict == "skip":
        raise SkipStage(f"job {job_id} is {values[0]}; {name} has nothing to do")
    if verdict == "cancelled":
        store.finish(job_id, JobStatus.cancelled, finish_reason=FinishReason.cancelled.value)
        if (trajectory := blobs.get("trajectory")) is not None:  # its episode ended before the cancel took effect
            mark_trajectory_cancelled(store, job_id, unpack(trajectory))
        raise SkipStage(f"job {job_id} was cancelled before {name}")
    if verdict == "leased":  # a live duplicate; should its holder die, housekeeping re-sends the stage
        raise SkipStage(f"job {job_id} is in {name} under another worker's lease")
    deadline_at, attempts, rollout_index = float(values[0]), int(values[1]), int(values[2] or 0)
    leases.hold(job_id, owner, name)
    ctx = StageContext(job_id, name, store, settings, deadline_at, attempts, rollout_index, blobs)
    end: StageEnd | None = StageEnd(job_id, owner)
    try:
        if attempts > settings.max_redeliveries:
            raise RedeliveryLimit(
                f"{name} of job {job_id} was delivered {attempts} times without finishing "
                f"(worker crashes?); giving up. Raise ROLLOUT_MAX_REDELIVERIES to allow more."
            )
        if ctx.remaining_s() <= 0:
            raise DeadlineExceeded(
                f"job deadline passed before {name} started; raise timeouts.job_s or add workers for this queue"
            )
        yield ctx
        assert end is not None
        end.fields, end.blobs, end.finish = {f"{name}_end": time.time(), **ctx.end_fields}, ctx.results, ctx.finish_as
    except STORE_OUTAGE as exc:
        end = None
        after_store_outage(ctx, owner, exc)
    except DeadlineExceeded as exc:
        store.finish(job_id, JobStatus.timed_out, exc, finish_reason=FinishReason.deadline.value)
    except SandboxError as exc:
        if worker_state.should_stop is None and worker_state.should_terminate is None:
            log.warning("job %s failed in %s: %s", job_id, name, exc)
            _end_failed(store, job_id, name, exc)
        else:  # the worker's stop (Slurm signals every process, sandboxes too): its lease lapses, recovery re-sends
            log.warning("job %s left to recovery: its sandbox failed as this worker stops: %s", job_id, exc)
            end = None
    except RolloutError as exc:
        log.warning("job %s failed in %s: %s", job_id, name, exc)
        _end_failed(store, job_id, name, exc)
    except Exception as exc:  # an unexpected bug still ends the job with a reason
        log.exception("job %s crashed in %s", job_id, name)
        _end_failed(store, job_id, name, exc)
    finally:
        leases.drop(job_id)
        if end is not None:
            end.call = ctx.end_call
            ended.append(end)


def after_store_outage(ctx: StageContext, owner: str, exc: Exception) -> None:
    """Redis stayed away longer than a worker's commands wait (``redis_outage_wait_s``): the job
    is not failed for it. Once Redis answers, the stage gives the job back to its queue for another
    delivery; if the job's deadline passed meanwhile, it ends ``timed_out`` naming the store. Should
    Redis stay away past the deadline by another wait, or go away again, housekeeping finds the job
    once it is back."""
    log.warning("job %s left to another delivery of %s: the state store is away (%s)", ctx.job_id, ctx.stage, exc)
    store = ctx.store
    give_up_at = max(ctx.deadline_at, time.time()) + ctx.settings.redis_outage_wait_s
    while True:
        try:
            store.redis.ping()
            break
        except STORE_OUTAGE:
            if time.time() > give_up_at:
                return
    try:
        if ctx.remaining_s() <= 0:
            reason = DeadlineExceeded(
                f"the job's deadline passed while the state store (Redis) was unreachable during {ctx.stage}: {exc}"
            )
            store.finish(ctx.job_id, JobStatus.timed_out, reason, finish_reason=FinishReason.deadline.value)
            return
        store.hand_back(ctx.job_id, ctx.stage, owner, ctx.attempt)
        dispatch.enqueue_from(ctx.job_id, ctx.stage)
    except Exception:  # away again: housekeeping finds the job once its lease lapses
        log.warning("job %s: left to housekeeping", ctx.job_id, exc_info=True)


def mark_trajectory_cancelled(store: JobStore, job_id: str, trajectory: dict[str, Any] | None) -> None:
    """A job that ends cancelled has a trajectory that says so (its turns kept), whatever ended
    the episode first: the job's view and its trajectory agree."""
    if trajectory is not None and trajectory.get("finish_reason") != FinishReason.cancelled.value:
        trajectory.update(finish_reason=FinishReason.cancelled.value, truncated=True)
        store.put_blob(job_id, "trajectory", trajectory)


def _end_failed(store: JobStore, job_id: str, name: str, exc: Exception) -> None:
    if store.cancel_requested(job_id):
        store.finish(job_id, JobStatus.cancelled, finish_reason=FinishReason.cancelled.value)
        mark_trajectory_cancelled(store, job_id, store.get_blob(job_id, "trajectory", None))
    else:
        store.set_fields(job_id, **{f"{name}_end": time.time()})
        store.finish(job_id, JobStatus.failed, exc)


def run_stage_jobs(
    job_ids: Sequence[str],
    name: str,
    body: Callable[[StageContext], None],
    end_each: bool = False,
    calls: dict[str, BeginCall] | None = None,
) -> list[str]:
    """Stage ``name`` for each job in turn, with one round trip to begin them all and one to end
    them all (``end_each``: one per job, as soon as its body returns, for a stage whose jobs take
    long enough that a finished one should not wait for the rest of its message); the jobs still
    live go on to the next stage. ``calls``: what a job's begin also does (``JobStore.begin_stages``).
    Returns those, once published there."""
    store, owner = job_store(), new_owner()
    begun = store.begin_stages(
        list(job_ids),
        name,
        PREVIOUS_STATUS[name],
        STAGE_STATUS[name],
        owner,
        STAGE_READS[name],
        BEGINS_SKIPPING.get(name),
        calls,
    )
    ended: list[StageEnd] = []
    statuses: list[JobStatus | None] = []
    finished = Increments()  # the metrics of the jobs that ended: one write for the message
    for job_id, answer in zip(job_ids, begun):
        try:
            with stage(store, job_id, name, answer, owner, ended) as ctx:
                body(ctx)
        except SkipStage as reason:
            log.info("%s", reason)
        except STORE_OUTAGE:  # recording a failure met Redis away: the job is left to housekeeping
            log.warning("job %s left to housekeeping: the state store is away", job_id, exc_info=True)
        if end_each:
            statuses += store.end_stages(ended[len(statuses) :], finished)
    statuses += store.end_stages(ended[len(statuses) :], finished)
    finished.write(store.redis, "job")
    going_on = [
        end.job_id for end, status in zip(ended, statuses) if status is not None and status not in TERMINAL_STATUSES
    ]
    wait_published([hand_on(job_id, name) for job_id in going_on])
    return going_on


def hand_on(job_id: str, name: str) -> threading.Event | None:
    """Hand a job that finished stage ``name`` to the next stage (set once published)."""
    following = dispatch.STAGES.index(name) + 1
    if following == len(dispatch.STAGES):
        return None
    return dispatch.handoff().put(dispatch.STAGES[following], job_id)


def wait_published(published: Sequence[threading.Event | None]) -> None:
    for event in published:
        if event is not None:
            event.wait()
