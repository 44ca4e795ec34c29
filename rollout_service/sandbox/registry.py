"""Every running sandbox in Redis, so that a reaper can kill what outlived its expiry.

``rollout:sandbox:<id>`` is a hash (host, pid, pid_start, owner_pid, owner_start, expiry, job_id,
kind, socket_dir); ``rollout:sandbox:expiry`` is a sorted set of ids by expiry time. Its size is the
``rollout_sandboxes_alive`` gauge, so the reaper also takes the sandboxes of a worker that is gone
(killed, or stopped before its background stops ran), not only the expired ones.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from typing import Any

from rollout_service.sandbox.processes import kill_tree, owner_alive, process_start_ticks, sweep_orphaned_scratch
from rollout_service.settings import get_settings

PREFIX = "rollout:sandbox"
EXPIRY_KEY = f"{PREFIX}:expiry"


def sandbox_key(sandbox_id: str) -> str:
    return f"{PREFIX}:{sandbox_id}"


def register(redis_client: Any, sandbox: Any) -> None:
    pid = sandbox.process.pid
    expiry = time.time() + float(sandbox.spec.ttl_s)
    record = {
        "host": socket.gethostname(),
        "pid": pid,
        "pid_start": process_start_ticks(pid) or 0,
        "owner_pid": os.getpid(),
        "owner_start": process_start_ticks(os.getpid()) or 0,
        "expiry": expiry,
        "job_id": sandbox.spec.job_id,
        "kind": sandbox.kind,
        "socket_dir": sandbox.socket_dir or "",
        "started_at": time.time(),
    }
    pipe = redis_client.pipeline(transaction=False)  # in a green worker: part of the shared round trip
    pipe.hset(sandbox_key(sandbox.sandbox_id), mapping=record)
    pipe.zadd(EXPIRY_KEY, {sandbox.sandbox_id: expiry})
    pipe.execute()


def unregister(redis_client: Any, sandbox_id: str) -> None:
    pipe = redis_client.pipeline(transaction=False)  # in a green worker: part of the shared round trip
    pipe.delete(sandbox_key(sandbox_id))
    pipe.zrem(EXPIRY_KEY, sandbox_id)
    pipe.execute()


def registered(redis_client: Any, sandbox_id: str) -> dict[str, str]:
    raw = redis_client.hgetall(sandbox_key(sandbox_id))
    return {as_text(k): as_text(v) for k, v in raw.items()}


def reap_expired(redis_client: Any, host: str | None = None) -> list[str]:
    """Reap the sandboxes whose expiry has passed, and those of this machine whose worker process is
    gone, and return their ids: those of ``host`` only, or of every host when ``host`` is None.
    Processes are killed only on this machine (a pid means nothing elsewhere); the expired records of
    other hosts are just dropped. Then remove this machine's scratch directories of gone processes
    (made before their sandbox was registered, or by one-shot grading sandboxes, never registered)."""
    here = socket.gethostname()
    now = time.time()
    reaped = []
    entries = redis_client.zrange(EXPIRY_KEY, 0, -1, withscores=True)
    pipe = redis_client.pipeline(transaction=False)
    for raw_id, _ in entries:
        pipe.hgetall(sandbox_key(as_text(raw_id)))
    for (raw_id, expiry), raw in zip(entries, pipe.execute() if entries else []):
        sandbox_id = as_text(raw_id)
        record = {as_text(k): as_text(v) for k, v in raw.items()}
        if not record:
            if expiry <= now:
                redis_client.zrem(EXPIRY_KEY, sandbox_id)
            continue
        if host is not None and record.get("host") != host:
            continue
        local = record.get("host") == here
        orphaned = (
            local
            and "owner_pid" in record
            and not owner_alive(int(record["owner_pid"] or 0), int(record.get("owner_start") or -1))
        )
        if expiry > now and not orphaned:
            continue
        if local:
            pid = int(record.get("pid") or 0)
            if pid > 0 and process_start_ticks(pid) == int(record.get("pid_start") or -1):
                kill_tree(pid, get_settings().sandbox_stop_niceness)
            if record.get("socket_dir"):
                shutil.rmtree(record["socket_dir"], ignore_errors=True)
        unregister(redis_client, sandbox_id)
        reaped.append(sandbox_id)
    sweep_orphaned_scratch([get_settings().scratch_path, tempfile.gettempdir()])
    return reaped


def as_text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
