"""The one door to Celery: the only module that names tasks, queues and kombu keys.

Everything else (gateway routes, batches, the control worker) asks this module to enqueue,
revoke or announce, and never builds a signature itself. Importing it registers the batch
event with the job store (``JobStore.finish`` then announces a batch member's end here).
"""
from __future__ import annotations

import json
from typing import Iterable

import redis
from celery import chain

from rollout_service import store as job_store_module
from rollout_service.errors import UnknownName
from workers.celery_app import HEARTBEAT_KEY_PREFIX, app

STAGES = ("init", "run", "eval")
QUEUES = ("init", "run", "eval", "control")
TASK_NAMES = {
    "init": "workers.init.init_job",
    "run": "workers.run.run_job",
    "eval": "workers.eval.eval_job",
}
SCORE_TASK = "workers.eval.score_submission"
BATCH_MEMBER_DONE_TASK = "workers.control.batch_member_done"
HOUSEKEEPING_TASK = "workers.control.housekeeping"
# kombu's Redis transport: a queue is a list named after it (plus one list per extra priority
# step), and delivered-but-unacked messages sit in the ``unacked`` hash until acked.
KOMBU_PRIORITY_SEPARATOR = "\x06\x16"
KOMBU_PRIORITY_STEPS = (3, 6, 9)
KOMBU_UNACKED = "unacked"

# Which of ARGV[3:] (task ids) the messages of list KEYS[1] from index ARGV[1] to ARGV[2] carry
# (a hash's values when ARGV[1] is -1). kombu stores a message as JSON whose first "id" is the task
# id (Celery's protocol-2 headers).
_MESSAGES_PRESENT = """
local wanted, found = {}, {}
for i = 3, #ARGV do wanted[ARGV[i]] = true end
local raws
if ARGV[1] == '-1' then raws = redis.call('HVALS', KEYS[1])
else raws = redis.call('LRANGE', KEYS[1], ARGV[1], ARGV[2]) end
for _, raw in ipairs(raws) do
  local id = string.match(raw, '"id": "([^"]+)"')
  if id and wanted[id] then found[#found + 1] = id; wanted[id] = nil end
end
return {found, #raws}
"""
SCAN_CHUNK = 500  # messages per server-side scan step (2,000 took 13 ms of Redis time with 1.6 KB messages)


def stage_task_id(job_id: str, stage: str) -> str:
    return f"{job_id}.{stage}"


def pipeline_for(job_id: str, first_stage: str = "init") -> chain:
    """init → run → eval (or the tail from ``first_stage``), every link routed to its queue
    with a deterministic, revocable id."""
    if first_stage not in STAGES:
        raise UnknownName("stage", first_stage, STAGES)
    return chain(*(
        app.signature(TASK_NAMES[stage], args=(job_id,), immutable=True).set(
            queue=stage, task_id=stage_task_id(job_id, stage))
        for stage in STAGES[STAGES.index(first_stage):]
    ))


def stage_task_ids(job_id: str) -> list[str]:
    return [stage_task_id(job_id, stage) for stage in STAGES]


def enqueue_jobs(job_ids: Iterable[str], first_stage: str = "init") -> None:
    """Publish every job's chain through one producer (one broker connection for all of them)."""
    with app.producer_or_acquire() as producer:
        for job_id in job_ids:
            pipeline_for(job_id, first_stage).apply_async(producer=producer)


def enqueue_from(job_id: str, stage: str) -> None:
    """Re-enqueue a job from ``stage`` on (the control worker's recovery of a lost stage)."""
    enqueue_jobs([job_id], first_stage=stage)


def revoke_job(job_id: str) -> None:
    """Revoke a job's queued links (workers drop them on delivery)."""
    app.control.revoke(stage_task_ids(job_id))


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


def messages_present(client: redis.Redis, task_ids: list[str]) -> set[str]:
    """The task ids that some message waiting in a queue, or delivered and not acked yet, carries.
    Scans every queue list head to tail in chunks of SCAN_CHUNK (kombu pushes at the head and pops
    at the tail, so a message that stays queued is never skipped), then the unacked hash; only
    matches come back from the server."""
    wanted, found = list(task_ids), set()
    script = client.register_script(_MESSAGES_PRESENT)
    for key in [f"{queue}{KOMBU_PRIORITY_SEPARATOR}{step}" if step else queue
                for queue in QUEUES for step in (0, *KOMBU_PRIORITY_STEPS)]:
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
    lengths = {q: {"queued": sum(replies[i * per_queue:(i + 1) * per_queue]), "unacked": 0}
               for i, q in enumerate(QUEUES)}
    for raw in replies[-1]:
        try:
            routing_key = json.loads(raw)[2]
        except (ValueError, IndexError, TypeError):
            continue
        if routing_key in lengths:
            lengths[routing_key]["unacked"] += 1
    return lengths
