"""control queue: bookkeeping (expired sandboxes, leaked backend counts, backend health).

Every control worker runs housekeeping on a timer; a Redis lock makes one of them do it per
interval, so adding control workers adds no duplicate probes.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import threading
import time
from typing import Any, cast

import redis
from celery.signals import worker_ready

from rollout_service.errors import StoreUnavailable
from rollout_service.schemas import JobStatus
from rollout_service.settings import get_settings
from rollout_service.state.backends import BackendPool
from rollout_service.state.connection import broker_client
from rollout_service.state.keys import recovery_field
from rollout_service.state.store import JobStore
from workers import dispatch
from workers.celery_app import app
from workers.stage import STAGE_STATUS, job_store

log = logging.getLogger(__name__)
LOCK_KEY = "rollout:housekeeping:lock"
LOST_SCAN_KEY = "rollout:housekeeping:lost-message-scan"
RECONCILE_KEY = "rollout:housekeeping:reconcile"
ORPHAN_SCAN_KEY = "rollout:housekeeping:orphan-scan"
UNLEASED_KEY = "rollout:housekeeping:unleased"  # job -> when a scan first found its begun stage without a lease
STAGE_OF_STATUS = {status.value: stage for stage, status in STAGE_STATUS.items()}


@app.task(name=dispatch.HOUSEKEEPING_TASK)
def housekeeping() -> dict[str, Any]:
    """Cluster-wide bookkeeping; one control worker runs it per interval."""
    store = job_store()
    pool = BackendPool(store.redis)
    lease_ttl_s = store.settings.lease_ttl_s
    report = {
        "recovered_jobs": recover_orphans(store) if _due(store, ORPHAN_SCAN_KEY, lease_ttl_s / 4) else [],
        "leaked_assignments": pool.reconcile(store.live_jobs()) if _due(store, RECONCILE_KEY, lease_ttl_s) else None,
        "health": pool.probe(),
        "expired_index_entries": store.trim_job_index(),
    }
    log.debug("housekeeping: %s", report)
    return report


def _due(store: JobStore, key: str, every_s: float) -> bool:
    """True at most once per ``every_s`` across the cluster's control workers, for the sweeps that
    read every live job or queued message (a lost stage waits two lease TTLs anyway, and a leaked
    assignment only skews the load heap)."""
    return bool(store.redis.set(key, "1", nx=True, px=max(int(every_s * 1000), 1)))


def remove_ended_workspaces(store: JobStore) -> list[str]:
    """Delete the workspaces (under this node's state dir) of jobs that ended or expired (no longer
    in the live set): nothing of a job outlives it on disk. Returns their job ids."""
    root = store.settings.workspaces_path
    try:
        job_ids = [entry.name for entry in os.scandir(root) if entry.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []
    ended = [job_id for job_id, live in zip(job_ids, store.are_live(job_ids)) if not live]
    for job_id in ended:
        shutil.rmtree(root / job_id, ignore_errors=True)
    return ended


ORPHAN_FIELDS = (
    "status",
    "created_at",
    "first_stage",
    *(field for stage in dispatch.STAGES for field in (f"{stage}_start", f"{stage}_end", f"attempts_{stage}")),
)


def recover_orphans(store: JobStore) -> list[str]:
    """Re-enqueue the stage a live job waits on when nothing would ever run it:

    - its worker died mid-stage (status says running, nobody holds the lease): kombu would
      redeliver the unacked message only after the visibility timeout (hours);
    - its message is gone (queued, or between two stages, and no queue or unacked entry carries
      it): kombu's Redis transport loses a message it popped if the broker connection fails
      before it records the message as unacked.

    Housekeeping runs it at most every quarter lease TTL: it reads every live job's lease.

    A stage counts as lost after two lease TTLs; a begun stage, once two scans at least a lease TTL
    apart found it without a lease (a live holder takes a lease that lapsed while Redis was away
    again within a third of that). The re-sent stage is marked as that delivery's recovery: only
    it may take the stage over (``JobStore.begin_stages``). A late duplicate is harmless, the
    stage's own checks (status, lease, stage end, delivery count) skip it.
    """
    now = time.time()
    patience_s = store.settings.lease_ttl_s * 2
    live = sorted(store.live_jobs())
    with store.redis.pipeline(transaction=False) as pipe:  # a job under a lease has a live worker
        for job_id in live:
            pipe.exists(store.key(job_id, "lease"))
        leased = pipe.execute() if live else []
    job_ids = [job_id for job_id, held in zip(live, leased) if not held]
    with store.redis.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hmget(store.key(job_id), list(ORPHAN_FIELDS))
        replies = pipe.execute() if job_ids else []
    crashed: dict[str, tuple[str, str]] = {}  # job -> (stage, its delivery count)
    unsent: dict[str, str] = {}
    for job_id, values in zip(job_ids, replies):
        fields = {name: value.decode() for name, value in zip(ORPHAN_FIELDS, values) if value is not None}
        waiting = None if "status" not in fields else waiting_stage(fields)
        if waiting is None or now - waiting[1] < patience_s:
            continue
        stage, _, started = waiting
        if started:
            crashed[job_id] = (stage, fields.get(f"attempts_{stage}", "0"))
        else:
            unsent[job_id] = stage
    crashed = seen_unleased_twice(store, crashed, now)
    lost: dict[str, str] = {}
    # the broker scan reads every queued message: at most once per lease TTL, however deep the backlog
    if unsent and _due(store, LOST_SCAN_KEY, store.settings.lease_ttl_s):
        present = dispatch.messages_present(
            broker_client(store.redis), [dispatch.stage_mark(j, s) for j, s in unsent.items()]
        )
        lost = {j: s for j, s in unsent.items() if dispatch.stage_mark(j, s) not in present}
    claims = {  # once per delivery for a dead worker (its message stays unacked for hours), again two
        # lease TTLs later should the message that recovers it be lost too
        **{j: (s, f"recovery:{s}:{attempts}", "worker") for j, (s, attempts) in crashed.items()},
        # a lost message: the broker holds the new one from now on, so the next scan sees it
        **{j: (s, f"recovery:{s}:lost", "message") for j, s in lost.items()},
    }
    claim_s = int(patience_s) + 1
    recovered = []
    for job_id, (stage, claim, what) in claims.items():
        # claimed for one pass, counted again from the send: Redis dying between the two must not
        # leave a claim that outlives a message it never got (the job would wait forever)
        if store.redis.set(store.key(job_id, claim), "1", nx=True, ex=claim_s):
            log.warning("job %s lost its %s %s; re-enqueueing from %s", job_id, stage, what, stage)
            if job_id in crashed:
                store.set_fields(job_id, **{recovery_field(stage): crashed[job_id][1]})
            dispatch.enqueue_from(job_id, stage)
            store.redis.expire(store.key(job_id, claim), claim_s)
            recovered.append(job_id)
    return recovered


def seen_unleased_twice(store: JobStore, crashed: dict[str, tuple[str, str]], now: float) -> dict[str, tuple[str, str]]:
    """Those of ``crashed`` (begun stages without a lease) an earlier scan, a lease TTL ago at
    least, found so too; the others are remembered for the next scans."""
    recorded = cast(dict[bytes, bytes], store.redis.hgetall(UNLEASED_KEY))
    seen = {job_id.decode(): float(at) for job_id, at in recorded.items()}
    with store.redis.pipeline(transaction=False) as pipe:
        gone = [job_id for job_id in seen if job_id not in crashed]
        new = {job_id: now for job_id in crashed if job_id not in seen}
        if gone:
            pipe.hdel(UNLEASED_KEY, *gone)
        if new:
            pipe.hset(UNLEASED_KEY, mapping=new)
        pipe.execute()
    ttl_s = store.settings.lease_ttl_s
    return {job_id: found for job_id, found in crashed.items() if now - seen.get(job_id, now) >= ttl_s}


def waiting_stage(fields: dict[str, str]) -> tuple[str, float, bool] | None:
    """The stage the job waits on: (stage, waiting since, whether a worker had started it)."""
    if fields["status"] == JobStatus.queued.value:  # at the stage it was enqueued to (tasks.first_stage)
        return fields.get("first_stage", "init"), float(fields["created_at"]), False
    stage = STAGE_OF_STATUS.get(fields["status"])
    if stage is None:
        return None
    if f"{stage}_end" not in fields:
        return stage, float(fields.get(f"{stage}_start") or time.time()), True
    following = dispatch.STAGES.index(stage) + 1
    if following == len(dispatch.STAGES):
        return None
    return dispatch.STAGES[following], float(fields[f"{stage}_end"]), False


@worker_ready.connect
def _start_housekeeping(sender: Any, **_: Any) -> None:
    if "control" not in {q.name for q in sender.task_consumer.queues}:
        return
    interval_s = get_settings().backend_probe_interval_s

    def loop() -> None:
        from rollout_service.sandbox import reap_expired

        stop = threading.Event()
        while not stop.wait(interval_s):
            try:
                store = job_store()
                reap_expired(store.redis, socket.gethostname())  # every node reaps its own
                remove_ended_workspaces(store)
                if store.redis.set(LOCK_KEY, sender.hostname, nx=True, px=int(interval_s * 900)):
                    housekeeping()
            except Exception:
                log.warning("housekeeping failed; retrying next interval", exc_info=True)

    threading.Thread(target=loop, name="housekeeping", daemon=True).start()


@app.task(
    name=dispatch.BATCH_MEMBER_DONE_TASK,
    autoretry_for=(StoreUnavailable, redis.ConnectionError, redis.TimeoutError),
    retry_backoff=True,
    max_retries=8,
)
def batch_member_done(job_id: str) -> str:
    """A member of a batch reached a terminal state: decide its group, top the batch up, cancel
    what the batch no longer needs (see rollout_service.state.batches)."""
    from rollout_service.state.batches import BatchControl

    decision = BatchControl(job_store(), dispatch.enqueue_jobs).member_done(job_id)
    log.info("batch member %s: %s", job_id, decision)
    return decision
