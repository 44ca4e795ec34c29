"""control queue: bookkeeping (expired sandboxes, leaked backend counts, backend health)."""
from __future__ import annotations

import logging

from rollout_service.backends import BackendPool
from workers.celery_app import app
from workers.stage import job_store

log = logging.getLogger(__name__)


@app.task(name="workers.control.housekeeping")
def housekeeping() -> dict:
    from rollout_service.sandbox import reap_expired

    store = job_store()
    pool = BackendPool(store.redis)
    report = {
        "reaped_sandboxes": reap_expired(store.redis),
        "leaked_assignments": pool.reconcile(store.live_jobs()),
        "health": pool.probe(),
    }
    log.info("housekeeping: %s", report)
    return report
