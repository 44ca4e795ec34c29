"""What every stage task does around its body: skip finished jobs, count redeliveries,
hold the job's lease, enforce the deadline, and turn exceptions into a typed status."""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Iterator

from celery import Task
from celery.exceptions import Ignore

from rollout_service.errors import DeadlineExceeded, RedeliveryLimit, RolloutError
from rollout_service.schemas import TERMINAL_STATUSES, FinishReason, JobStatus
from rollout_service.settings import Settings, get_settings
from rollout_service.store import JobStore, redis_client

log = logging.getLogger(__name__)

STAGE_STATUS = {"init": JobStatus.initializing, "run": JobStatus.running, "eval": JobStatus.evaluating}
PREVIOUS_STATUS = {"init": JobStatus.queued, "run": JobStatus.initializing, "eval": JobStatus.running}


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

    def remaining_s(self) -> float:
        return self.deadline_at - time.time()

    def should_stop(self) -> bool:
        return self.store.cancel_requested(self.job_id) or time.time() >= self.deadline_at


def job_store() -> JobStore:
    settings = get_settings()
    return JobStore(redis_client(settings), settings)


@contextlib.contextmanager
def stage(task: Task, job_id: str, name: str) -> Iterator[StageContext]:
    """Run a stage body at most once at a time per job; end the job on any failure."""
    store = job_store()
    settings = store.settings
    status = store.status(job_id)
    if status in TERMINAL_STATUSES or status not in (PREVIOUS_STATUS[name], STAGE_STATUS[name]):
        raise SkipStage(f"job {job_id} is {status.value}; {name} has nothing to do")
    if store.cancel_requested(job_id):
        store.finish(job_id, JobStatus.cancelled, finish_reason=FinishReason.cancelled.value)
        raise SkipStage(f"job {job_id} was cancelled before {name}")
    owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    if not store.acquire_lease(job_id, owner):
        raise task.retry(countdown=settings.lease_ttl_s, max_retries=settings.max_redeliveries,
                         exc=RedeliveryLimit(f"job {job_id} stayed leased by another worker"))
    stop_renewing = threading.Event()
    renewer = threading.Thread(target=_renew, args=(store, job_id, owner, stop_renewing), daemon=True)
    renewer.start()
    try:
        attempts = store.count_attempt(job_id, name)
        if attempts > settings.max_redeliveries:
            raise RedeliveryLimit(
                f"{name} of job {job_id} was delivered {attempts} times without finishing "
                f"(worker crashes?); giving up. Raise ROLLOUT_MAX_REDELIVERIES to allow more.")
        ctx = StageContext(job_id, name, store, settings, store.deadline_at(job_id), attempts)
        if ctx.remaining_s() <= 0:
            raise DeadlineExceeded(f"job deadline passed before {name} started; "
                                   "raise timeouts.job_s or add workers for this queue")
        store.transition(job_id, STAGE_STATUS[name], (PREVIOUS_STATUS[name], STAGE_STATUS[name]),
                         **{f"{name}_start": time.time()})
        yield ctx
        store.set_fields(job_id, **{f"{name}_end": time.time()})
    except DeadlineExceeded as exc:
        store.finish(job_id, JobStatus.timed_out, exc, finish_reason=FinishReason.deadline.value)
    except RolloutError as exc:
        log.warning("job %s failed in %s: %s", job_id, name, exc)
        _end_failed(store, job_id, name, exc)
    except Exception as exc:  # an unexpected bug still ends the job with a reason
        log.exception("job %s crashed in %s", job_id, name)
        _end_failed(store, job_id, name, exc)
    finally:
        stop_renewing.set()
        store.release_lease(job_id, owner)


def _end_failed(store: JobStore, job_id: str, name: str, exc: Exception) -> None:
    if store.cancel_requested(job_id):
        store.finish(job_id, JobStatus.cancelled, finish_reason=FinishReason.cancelled.value)
    else:
        store.set_fields(job_id, **{f"{name}_end": time.time()})
        store.finish(job_id, JobStatus.failed, exc)


def _renew(store: JobStore, job_id: str, owner: str, stop: threading.Event) -> None:
    while not stop.wait(store.settings.lease_ttl_s / 3):
        try:
            store.renew_lease(job_id, owner)
        except Exception:  # a Redis blip: the next renewal tries again
            log.warning("could not renew lease of %s", job_id, exc_info=True)


def run_stage_task(task: Task, job_id: str, name: str, body: Callable[[StageContext], None]) -> None:
    """Run ``body`` as stage ``name``; stop the chain (Ignore) unless the job goes on."""
    try:
        with stage(task, job_id, name) as ctx:
            body(ctx)
    except SkipStage as reason:
        log.info("%s", reason)
        raise Ignore() from None
    if job_store().status(job_id) in TERMINAL_STATUSES:
        raise Ignore()
