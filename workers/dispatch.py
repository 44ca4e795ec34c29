"""The one door to Celery: the only module that names tasks, queues and kombu keys.

A stage message carries a list of job ids, not one job: under load one Celery task moves
dozens of jobs, so Celery's cost per task (delivery, events, ack) is paid per batch. The
gateway sends a submission's jobs to ``init`` in messages of up to ``stage_batch_max_jobs``;
each stage hands the jobs it finished to the next through a ``Handoff``, which gathers them
for ``handoff_window_ms`` into one message. Everything else (gateway routes, batches, the
control worker) asks this module to enqueue or announce. Importing it registers the batch
event with the job store (``JobStore.finish`` then announces a batch member's end here).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Iterable, Sequence

import redis

from rollout_service.errors import UnknownName
from rollout_service.settings import get_settings
from rollout_service.state import store as job_store_module
from rollout_service.state.store import STAGES
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
# kombu's Redis transport: a queue is a list named after it (plus one list per extra priority
# step), and delivered-but-unacked messages sit in the ``unacked`` hash until acked.
KOMBU_PRIORITY_SEPARATOR = "\x06\x16"
KOMBU_PRIORITY_STEPS = (3, 6, 9)
KOMBU_UNACKED = "unacked"
# kombu stores a message body base64-encoded but its headers as plain JSON: this header lists the
# message's jobs as "<job id>.<stage>" marks, so a server-side scan can tell which jobs a queue holds.
JOBS_HEADER = "rollout_jobs"

# Which of ARGV[3:] (marks) the messages of list KEYS[1] from index ARGV[1] to ARGV[2] carry
# (a hash's values when ARGV[1] is -1).
_MESSAGES_PRESENT = """
local wanted, found = {}, {}
for i = 3, #ARGV do wanted[ARGV[i]] = true end
local raws
if ARGV[1] == '-1' then raws = redis.call('HVALS', KEYS[1])
else raws = redis.call('LRANGE', KEYS[1], ARGV[1], ARGV[2]) end
for _, raw in ipairs(raws) do
  local marks = string.match(raw, '"rollout_jobs": %[(.-)%]')
  if marks then
    for mark in string.gmatch(marks, '"([^"]+)"') do
      if wanted[mark] then found[#found + 1] = mark; wanted[mark] = nil end
    end
  end
end
return {found, #raws}
"""
SCAN_CHUNK = 500  # messages per server-side scan step (2,000 took 13 ms of Redis time with 1.6 KB messages)


def stage_mark(job_id: str, stage: str) -> str:
    """The mark of ``job_id`` in a message of ``stage`` (see JOBS_HEADER)."""
    return f"{job_id}.{stage}"


def send_stage(stage: str, job_ids: Sequence[str]) -> None:
    """Publish ``job_ids`` to ``stage``'s queue, ``stage_batch_max_jobs`` per message, through one
    producer (one broker connection for all of them)."""
    if stage not in STAGES:
        raise UnknownName("stage", stage, STAGES)
    size = max(get_settings().stage_batch_max_jobs, 1)
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
            )


def enqueue_jobs(job_ids: Iterable[str], stage: str) -> None:
    """Start jobs at ``stage`` (``tasks.first_stage``: init, or run for domains that prepare
    cheaply); each stage hands them on to the next."""
    send_stage(stage, list(job_ids))


def enqueue_from(job_id: str, stage: str) -> None:
    """Re-enqueue a job from ``stage`` on (the control worker's recovery of a lost stage)."""
    send_stage(stage, [job_id])


QUIET_WINDOWS = 10  # a stage quiet this many windows hands its next job on at once


class Handoff:
    """Gathers the jobs a worker process hands to the next stages and publishes them together: at
    most one message per stage per ``window_s`` (or per ``max_jobs``), whatever the number of tasks
    and episodes that finished meanwhile. A job handed on after QUIET_WINDOWS quiet windows goes at
    once (at low load the window only added its length to every hop: 8 jobs of 2 turns at 0.2 s,
    0.51 -> 0.48 s); those that follow wait for the window. (Going at once after a single quiet
    window made 1000 x 4 slower: 5.70 and 5.88 s against 5.22 and 5.28 s.) ``put`` returns an
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
            send_stage(stage, jobs)
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
    """The job-store hook: a member of a batch ended, so the control queue decides its group."""
    if batch_id:
        app.send_task(BATCH_MEMBER_DONE_TASK, args=(job_id,), queue="control")


job_store_module.on_job_finished(announce_batch_member_done)


def served_queues(client: redis.Redis) -> set[str]:
    """Queues some live worker consumes, from the workers' heartbeat keys."""
    queues: set[str] = set()
    keys = list(client.scan_iter(f"{HEARTBEAT_KEY_PREFIX}*"))
    for value in client.mget(keys) if keys else []:
        if value:
            queues.update(value.decode().split(","))
    return queues


def messages_present(client: redis.Redis, marks: list[str]) -> set[str]:
    """The marks (``stage_mark``) that some message waiting in a queue, or delivered and not acked yet, carries.
    Scans every queue list head to tail in chunks of SCAN_CHUNK (kombu pushes at the head and pops
    at the tail, so a message that stays queued is never skipped), then the unacked hash; only
    matches come back from the server."""
    wanted, found = list(marks), set()
    script = client.register_script(_MESSAGES_PRESENT)
    for key in [
        f"{queue}{KOMBU_PRIORITY_SEPARATOR}{step}" if step else queue
        for queue in QUEUES
        for step in (0, *KOMBU_PRIORITY_STEPS)
    ]:
        start = 0
        while wanted:
            hits, seen = script(keys=[key], args=[start, start + SCAN_CHUNK - 1, *wanted])
            found.update(t.decode() for t in hits)
            wanted = [t for t in wanted if t not in found]
            if seen < SCAN_CHUNK:
                break
            start += SCAN_CHUNK
    if wanted:
        hits, _ = script(keys=[KOMBU_UNACKED], args=[-1, 0, *wanted])
        found.update(t.decode() for t in hits)
    return found


def queue_lengths(client: redis.Redis) -> dict[str, dict[str, int]]:
    """Per queue: ``queued`` (messages waiting in the broker lists, every priority step) and
    ``unacked`` (delivered to a worker and not acked yet). With late acks ``unacked`` counts
    reserved *and* running tasks: kombu does not record in Redis whether a delivered task started."""
    pipe = client.pipeline(transaction=False)
    for queue in QUEUES:
        pipe.llen(queue)
        for step in KOMBU_PRIORITY_STEPS:
            pipe.llen(f"{queue}{KOMBU_PRIORITY_SEPARATOR}{step}")
    pipe.hvals(KOMBU_UNACKED)
    replies = pipe.execute()
    per_queue = 1 + len(KOMBU_PRIORITY_STEPS)
    lengths = {
        q: {"queued": sum(replies[i * per_queue : (i + 1) * per_queue]), "unacked": 0} for i, q in enumerate(QUEUES)
    }
    for raw in replies[-1]:
        try:
            routing_key = json.loads(raw)[2]
        except (ValueError, IndexError, TypeError):
            continue
        if routing_key in lengths:
            lengths[routing_key]["unacked"] += 1
    return lengths
