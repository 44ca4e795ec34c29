"""control queue: bookkeeping (expired sandboxes, leaked backend counts, backend health).

Every control worker runs housekeeping on a timer; a Redis lock makes one of them do it per
interval, so adding control workers adds no duplicate probes.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

import redis
from celery.signals import worker_ready

from rollout_service.backends import BackendPool
from rollout_service.errors import NotFound, StoreUnavailable
from rollout_service.settings import get_settings
from rollout_service.store import JobStore
from workers import dispatch
from workers.celery_app import app
from workers.stage import STAGE_STATUS, job_store

log = logging.getLogger(__name__)
LOCK_KEY = "rollout:housekeeping:lock"
STAGE_OF_STATUS = {status.value: stage for stage, status in STAGE_STATUS.items()}


@app.task(name=dispatch.HOUSEKEEPING_TASK)
def housekeeping() -> dict[str, Any]:
    """Cluster-wide bookkeeping; one control worker runs it per interval."""
    store = job_store()
    pool = BackendPool(store.redis)
    report = {
        "recovered_jobs": recover_orphans(store),
        "leaked_assignments": pool.reconcile(store.live_jobs()),
        "health": pool.probe(),
        "expired_index_entries": store.trim_job_index(),
    }
    log.debug("housekeeping: %s", report)
    return report


def recover_orphans(store: JobStore) -> list[str]:
    """Re-enqueue stages whose worker died (status says running, nobody holds the lease).

    kombu would redeliver their unacked message only after the visibility timeout (hours);
    the stage's own checks (status, lease, delivery count) keep a late duplicate harmless.
    """
    recovered = []
    now = time.time()
    for job_id in store.live_jobs():
        try:
            f = store.fields(job_id)
        except NotFound:
            continue
        stage = STAGE_OF_STATUS.get(f["status"])
        if stage is None or f.get(f"{stage}_end") or store.redis.exists(store.key(job_id, "lease")):
            continue
        if now - float(f.get(f"{stage}_start") or now) < store.settings.lease_ttl_s * 2:
            continue
        claim = store.key(job_id, f"recovery:{stage}:{f.get(f'attempts_{stage}', 0)}")
        if store.redis.set(claim, "1", nx=True, ex=store.settings.job_ttl_s):
            log.warning("job %s lost its %s worker; re-enqueueing from %s", job_id, stage, stage)
            dispatch.enqueue_from(job_id, stage)
            recovered.append(job_id)
    return recovered


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
                if store.redis.set(LOCK_KEY, sender.hostname, nx=True, px=int(interval_s * 900)):
                    housekeeping()
            except Exception:
                log.warning("housekeeping failed; retrying next interval", exc_info=True)

    threading.Thread(target=loop, name="housekeeping", daemon=True).start()


@app.task(name=dispatch.BATCH_MEMBER_DONE_TASK,
          autoretry_for=(StoreUnavailable, redis.ConnectionError, redis.TimeoutError),
          retry_backoff=True, max_retries=8)
def batch_member_done(job_id: str) -> str:
    """A member of a batch reached a terminal state: decide its group, top the batch up, cancel
    what the batch no longer needs (see rollout_service.batches)."""
    from rollout_service.batches import BatchControl

    decision = BatchControl(job_store()).member_done(job_id)
    log.info("batch member %s: %s", job_id, decision)
    return decision
