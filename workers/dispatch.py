"""The one door to Celery: the only module that names tasks and queues (kombu's keys: rollout_service/concurrency/broker.py).

A stage message carries a list of job ids, not one job: under load one Celery task moves
dozens of jobs, so Celery's cost per task (delivery, events, ack) is paid per batch. The
gateway sends a submission's jobs to ``init`` in messages of up to ``stage_batch_max_jobs``;
each stage hands the jobs it finished to the next through a ``Handoff``, which gathers them
for ``handoff_window_ms`` into one message. Everything else (gateway routes, batches, the
control worker) asks this module to enqueue or announce; the job stores the workers and the
gateway build announce a batch member's end through ``announce_batch_member_done``.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Iterable, Sequence
from typing import cast

import redis

from rollout_service.concurrency import broker
from rollout_service.errors import UnknownName
from rollout_service.settings import get_settings
from rollout_service.state.keys import STAGES
from workers.celery_app import HEARTBEAT_KEY_PREFIX, app

log = logging.getLogger(__name__)
QUEUES = ("init", "run", "eval", "control")
TASK_NAMES = {
    "init": "workers.init.init_jobs",
    "run": "workers.run.run_jobs",
    "eval": "workers.eval.eval_jobs",
}
SCORE_TASK = "workers.eval.score_submission"
BATCH_MEMBER_DONE_TASK = "workers.control.batch_member_done"
HOUSEKEEPING_TASK = "workers.control.housekeeping"
JOBS_HEADER = broker.JOBS_HEADER  # lists a message's jobs as stage marks


def stage_mark(job_id: str, stage: str) -> str:
    """The mark of ``job_id`` in a message of ``stage`` (see JOBS_HEADER)."""
    return f"{job_id}.{stage}"


def send_stage(stage: str, job_ids: Sequence[str], ride_out_outages: bool = False) -> None:
    """Publish ``job_ids`` to ``stage``'s queue, ``stage_batch_max_jobs`` per message, through one
    producer (one broker connection for all of them). ``ride_out_outages``: a worker's hand-off,
    which waits for a restarting broker as its Redis commands do (``redis_outage_wait_s``)."""
    if stage not in STAGES:
        raise UnknownName("stage", stage, STAGES)
    settings = get_settings()
    size = max(settings.stage_batch_max_jobs, 1)
    patience = (
        {"retry_policy": {"max_retries": max(int(settings.redis_outage_wait_s), 3), "interval_max": 1.0}}
        if ride_out_outages
        else {}
    )
    with app.producer_or_acquire() as producer:
        for start in range(0, len(job_ids), size):
            chunk = list(job_ids[start : start + size])
            marks = [stage_mark(job_id, stage) for job_id in chunk]
            task_id = marks[0] if len(chunk) == 1 else f"{marks[0]}+{len(chunk) - 1}"  # as Flower lists it
            app.send_task(
                TASK_NAMES[stage],
                args=(chunk,),
                queue=stage,
                producer=producer,
                task_id=task_id,
                headers={JOBS_HEADER: marks},
                **patience,
            )


def enqueue_jobs(job_ids: Iterable[str], stage: str) -> None:
    """Start jobs at ``stage`` (``tasks.first_stage``: init, or run for domains that prepare
    cheaply); each stage hands them on to the next."""
    send_stage(stage, list(job_ids))


def enqueue_from(job_id: str, stage: str) -> None:
    """Re-enqueue a job from ``stage`` on (the control worker's recovery of a lost stage)."""
    send_stage(stage, [job_id], ride_out_outages=True)


QUIET_WINDOWS = 10  # a stage quiet this many windows hands its next job on at once


class Handoff:
    """Gathers the jobs a worker process hands to the next stages and publishes them together: at
    most one message per stage per ``window_s`` (or per ``max_jobs``), whatever the number of tasks
    and episodes that finished meanwhile. A job handed on after QUIET_WINDOWS quiet windows goes at
    once (at low load the window would only add its length to every hop); those that follow wait
    for the window (one quiet window is not enough: under load the jobs would go one by one).
    ``put`` returns an
    event set once the job is published; a task waits for its jobs' events before it returns, so
    its late ack never precedes them."""

    def __init__(self, window_s: float, max_jobs: int) -> None:
        self.window_s = window_s
        self.max_jobs = max(max_jobs, 1)
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[list[str], threading.Event]] = {}
        self._last_sent: dict[str, float] = {}  # per stage, when its last message was taken to publish
        self._wake = threading.Event()
        self._pid = 0

    def put(self, stage: str, job_id: str) -> threading.Event:
        with self._lock:
            if self._pid != os.getpid():  # first use in this process (or a forked child)
                self._pid, self._pending, self._last_sent = os.getpid(), {}, {}
                threading.Thread(target=self._flush_forever, name="handoff", daemon=True).start()
            jobs, published = self._pending.setdefault(stage, ([], threading.Event()))
            jobs.append(job_id)
            now = time.monotonic()
            if (
                len(jobs) < self.max_jobs
                and now - self._last_sent.get(stage, -math.inf) < QUIET_WINDOWS * self.window_s
            ):
                self._wake.set()
                return published
            del self._pending[stage]
            self._last_sent[stage] = now
        self._publish(stage, jobs, published)
        return published

    def _flush_forever(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                due = min((self._last_sent.get(stage, -math.inf) for stage in self._pending), default=0.0)
            time.sleep(max(due + self.window_s - time.monotonic(), 0.0))
            with self._lock:
                taken, self._pending = self._pending, {}
                self._last_sent.update((stage, time.monotonic()) for stage in taken)
            for stage, (jobs, published) in taken.items():
                self._publish(stage, jobs, published)

    @staticmethod
    def _publish(stage: str, jobs: list[str], published: threading.Event) -> None:
        try:
            send_stage(stage, jobs, ride_out_outages=True)
        except Exception:  # the broker is away: housekeeping re-sends jobs no message carries
            log.warning("could not hand %d jobs to %s; housekeeping will re-send them", len(jobs), stage, exc_info=True)
        finally:
            published.set()


_handoff: Handoff | None = None


def handoff() -> Handoff:
    global _handoff
    if _handoff is None:
        settings = get_settings()
        _handoff = Handoff(settings.handoff_window_ms / 1000, settings.stage_batch_max_jobs)
    return _handoff


def submit_score(score_id: str) -> None:
    app.signature(SCORE_TASK, args=(score_id,)).set(queue="eval").apply_async()


def announce_batch_member_done(job_id: str, batch_id: str) -> None:
    """The job-store hook: a member of a batch ended, so the control queue decides its group. With
    the broker away the event is lost, not the job's end: the batch heals undecided members
    (``BatchControl.heal``) when it is next read."""
    if not batch_id:
        return
    try:
        app.send_task(BATCH_MEMBER_DONE_TASK, args=(job_id,), queue="control")
    except Exception:
        log.warning("could not announce batch member %s; its batch decides it when next read", job_id, exc_info=True)


def served_queues(client: redis.Redis) -> set[str]:
    """Queues some live worker consumes, from the workers' heartbeat keys."""
    queues: set[str] = set()
    keys = list(client.scan_iter(f"{HEARTBEAT_KEY_PREFIX}*"))
    for value in cast(list[bytes | None], client.mget(keys)) if keys else []:
        if value:
            queues.update(value.decode().split(","))
    return queues


def messages_present(client: redis.Redis, marks: list[str]) -> set[str]:
    """The marks (``stage_mark``) that some message waiting in a queue, or delivered and not acked yet, carries."""
    return broker.messages_present(client, QUEUES, marks)


def queue_lengths(client: redis.Redis) -> dict[str, dict[str, int]]:
    """Per queue: ``queued`` and ``unacked`` messages (``broker.queue_lengths``)."""
    return broker.queue_lengths(client, QUEUES)
