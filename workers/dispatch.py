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

# Which of ARGV (task ids) some message in the KEYS (queue lists, then the unacked hash) carries.
# kombu stores a message as JSON whose first "id" is the task id (Celery's protocol-2 headers).
_MESSAGES_PRESENT = """
local wanted, found = {}, {}
for _, id in ipairs(ARGV) do wanted[id] = true end
local function look(raw)
  local id = string.match(raw, '"id": "([^"]+)"')
  if id and wanted[id] then found[#found + 1] = id; wanted[id] = nil end
end
for i = 1, #KEYS - 1 do
  for _, raw in ipairs(redis.call('LRANGE', KEYS[i], 0, -1)) do look(raw) end
end
for _, raw in ipairs(redis.call('HVALS', KEYS[#KEYS])) do look(raw) end
return found
"""


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
    One server-side scan of every queue list and the unacked hash (only matches come back)."""
    if not task_ids:
        return set()
    keys = [f"{queue}{KOMBU_PRIORITY_SEPARATOR}{step}" if step else queue
            for queue in QUEUES for step in (0, *KOMBU_PRIORITY_STEPS)]
    return {t.decode() for t in client.eval(_MESSAGES_PRESENT, len(keys) + 1, *keys, KOMBU_UNACKED, *task_ids)}


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
