"""A whole service on this machine, for tests, benchmarks and demos: its own redis-server, the
gateway under gunicorn and one Celery worker process per queue, as ``rollout-service up`` runs them."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import redis

from rollout_service.devtools.redis_server import RedisServer, free_port
from rollout_service.launch.commands import WORKER_POOLS, gateway_command, wait_http, worker_command
from rollout_service.launch.supervisor import INTAKE, Supervisor
from rollout_service.sdk.client import RolloutClient
from rollout_service.settings import Settings


@dataclass
class LocalService:
    url: str
    redis_url: str
    state_dir: Path
    supervisor: Supervisor
    env: dict[str, str]
    redis_server: RedisServer

    def client(self, token: str | None = None) -> RolloutClient:
        return RolloutClient(self.url, token=token, timeout_s=120)

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url)

    def log(self, name: str) -> str:
        return (self.supervisor.log_dir / f"{name}.log").read_text(errors="replace")


@contextlib.contextmanager
def local_service(state: Path, appendonly: bool = True, **settings_env: str) -> Iterator[LocalService]:
    """Start it under ``state``; ``settings_env`` are ROLLOUT_* overrides (e.g. ROLLOUT_RUN_CONCURRENCY="8")."""
    redis_server = RedisServer(state / "redis", appendonly=appendonly).start()
    port = free_port()
    env = {
        **os.environ,
        **settings_env,
        "ROLLOUT_REDIS_URL": redis_server.url,
        "ROLLOUT_STATE_DIR": str(state),
        "ROLLOUT_PORT": str(port),
    }
    env.pop("ROLLOUT_API_TOKEN", None)
    settings = Settings.from_env(env)
    running = LocalService(
        f"http://127.0.0.1:{port}", redis_server.url, state, Supervisor(state / "logs", env), env, redis_server
    )
    try:
        running.supervisor.start("gateway", gateway_command(settings, bind="127.0.0.1"), stop_rank=INTAKE)
        for queue in WORKER_POOLS:
            running.supervisor.start(f"worker-{queue}", worker_command(settings, queue))
        wait_http(f"{running.url}/readyz", running.supervisor, 90)
        yield running
    finally:
        running.supervisor.stop()
        running.redis_server.stop()  # the one running now: a fault test may have restarted it
