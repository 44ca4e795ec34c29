"""control queue: bookkeeping (expired sandboxes, leaked backend counts, backend health).

Every control worker runs housekeeping on a timer; a Redis lock makes one of them do it per
interval, so adding control workers adds no duplicate probes.
"""
from __future__ import annotations

import logging
import threading
from typing import Any

from celery.signals import worker_ready

from rollout_service.backends import BackendPool
from rollout_service.settings import get_settings
from workers.celery_app import app
from workers.stage import job_store

log = logging.getLogger(__name__)
LOCK_KEY = "rollout:housekeeping:lock"


@app.task(name="workers.control.housekeeping")
def housekeeping() -> dict[str, Any]:
    from rollout_service.sandbox import reap_expired

    store = job_store()
    pool = BackendPool(store.redis)
    report = {
        "reaped_sandboxes": reap_expired(store.redis),
        "leaked_assignments": pool.reconcile(store.live_jobs()),
        "health": pool.probe(),
    }
    log.debug("housekeeping: %s", report)
    return report


@worker_ready.connect
def _start_housekeeping(sender: Any, **_: Any) -> None:
    if "control" not in {q.name for q in sender.task_consumer.queues}:
        return
    interval_s = get_settings().backend_probe_interval_s

    def loop() -> None:
        stop = threading.Event()
        while not stop.wait(interval_s):
            try:
                store = job_store()
                if store.redis.set(LOCK_KEY, sender.hostname, nx=True, px=int(interval_s * 900)):
                    housekeeping()
            except Exception:
                log.warning("housekeeping failed; retrying next interval", exc_info=True)

    threading.Thread(target=loop, name="housekeeping", daemon=True).start()
