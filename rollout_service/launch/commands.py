"""The commands that start the service's processes (gateway, Celery workers, Flower) and the wait
for one to answer, shared by ``rollout-service up`` and the local service of tests and benchmarks."""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from rollout_service.errors import ConfigError
from rollout_service.launch.supervisor import Supervisor
from rollout_service.settings import Settings

WORKER_POOLS = {  # queue -> (celery pool, settings field with its concurrency)
    "init": ("gevent", "init_concurrency"),
    "run": ("gevent", "run_concurrency"),
    "eval": ("prefork", "eval_concurrency"),
    "control": ("threads", "control_concurrency"),
}
POOL_KINDS = ("threads", "gevent", "prefork")
AUTOSCALING_POOLS = ("prefork", "gevent")  # Celery's thread pool cannot grow or shrink


@dataclass(frozen=True)
class WorkerOptions:
    """Overrides of one worker's defaults (pool and concurrency from WORKER_POOLS and settings)."""

    pool: str | None = None
    concurrency: int | None = None
    autoscale: tuple[int, int] | None = None  # (max, min) processes or greenlets
    hostname: str | None = None  # Celery node name; default <queue>-<random>@<host>, unique per process


def local_address(settings: Settings) -> str:
    """Where this machine reaches what listens on ``bind_host``."""
    return "127.0.0.1" if settings.bind_host in ("0.0.0.0", "::", "") else settings.bind_host


def gateway_command(settings: Settings, bind: str | None = None) -> list[str]:
    return [
        sys.executable,
        "-m",
        "gunicorn",
        "--workers",
        str(settings.gateway_workers),
        "--threads",
        "8",
        "--bind",
        f"{bind or settings.bind_host}:{settings.port}",
        "--timeout",
        "120",
        "--graceful-timeout",
        "10",
        "workers.wsgi:create_app()",
    ]


def worker_command(settings: Settings, queue: str, options: WorkerOptions = WorkerOptions()) -> list[str]:
    if queue not in WORKER_POOLS:
        raise ConfigError(f"unknown queue {queue!r}; valid: {', '.join(WORKER_POOLS)}")
    default_pool, concurrency_field = WORKER_POOLS[queue]
    pool = options.pool or default_pool
    if pool not in POOL_KINDS:
        raise ConfigError(f"unknown pool {pool!r}; valid: {', '.join(POOL_KINDS)}")
    if pool == "gevent":
        import importlib.util

        if importlib.util.find_spec("gevent") is None:
            raise ConfigError("--pool gevent needs the gevent package: pip install gevent, or use --pool threads")
    if options.autoscale and pool not in AUTOSCALING_POOLS:
        raise ConfigError(
            f"--autoscale needs a pool that can grow ({', '.join(AUTOSCALING_POOLS)}), "
            f"not {pool!r}: add --pool prefork, or give a fixed --concurrency instead"
        )
    if options.autoscale:
        sizing = ["--autoscale", f"{options.autoscale[0]},{options.autoscale[1]}"]
    else:
        sizing = ["-c", str(options.concurrency or getattr(settings, concurrency_field))]
    hostname = options.hostname or f"{queue}-{uuid.uuid4().hex[:6]}@%h"
    return [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "workers.celery_app",
        "worker",
        "-Q",
        queue,
        "-P",
        pool,
        *sizing,
        "-n",
        hostname,
        "--loglevel",
        settings.worker_log_level,
        *(["-E"] if settings.task_events else []),
        "--without-gossip",
        "--without-mingle",
    ]


FLOWER_NICENESS = 10
FLOWER_USER = "rollout"
WATCH_INTERVAL_S = 0.5


def flower_command(settings: Settings) -> list[str]:
    return [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "workers.celery_app",
        "flower",
        f"--port={settings.flower_port}",
        f"--address={settings.bind_host}",
        f"--enable_events={settings.task_events}",
    ]  # Flower would otherwise turn worker events back on


def answers_within(
    url: str, check: Callable[[], None], timeout_s: float, poll_s: float = 0.3, ok: tuple[int, ...] = (200,)
) -> bool:
    """Whether ``url`` answers with a status in ``ok`` within ``timeout_s``, asked every ``poll_s``;
    ``check`` runs before each try and raises to give up (the server behind it died)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        check()
        try:
            if httpx.get(url, timeout=2).status_code in ok:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    return False


def wait_http(url: str, supervisor: Supervisor, timeout_s: float, ok: tuple[int, ...] = (200,)) -> None:
    if not answers_within(url, supervisor.check, timeout_s, ok=ok):
        raise ConfigError(f"{url} did not become ready within {timeout_s:.0f} s; see logs in {supervisor.log_dir}")
