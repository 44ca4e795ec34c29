"""The whole service for end-to-end tests: its own redis-server, the gateway under gunicorn,
and one real Celery worker per queue, each a separate process, as `rollout-service up` runs them."""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pytest
import redis

from rollout_service.cli import WORKER_POOLS, Supervisor, gateway_command, wait_http, worker_command
from rollout_service.client import RolloutClient
from rollout_service.errors import ApiError
from rollout_service.redis_server import RedisServer, free_port
from rollout_service.schemas import BackendView
from rollout_service.settings import Settings

SERVICE_SETTINGS = {
    "ROLLOUT_GATEWAY_WORKERS": "2",
    "ROLLOUT_RUN_CONCURRENCY": "8",
    "ROLLOUT_EVAL_CONCURRENCY": "2",
    "ROLLOUT_INIT_CONCURRENCY": "2",
    "ROLLOUT_LEASE_TTL_S": "10",
    "ROLLOUT_LLM_CONNECT_RETRIES": "1",
}


@dataclass
class Service:
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
def running_service(state: Path, **settings_env: str) -> Iterator[Service]:
    """A whole service under ``state``; ``settings_env`` overrides ROLLOUT_* settings."""
    redis_server = RedisServer(state / "redis").start()
    port = free_port()
    env = {**os.environ, **SERVICE_SETTINGS, **settings_env, "ROLLOUT_REDIS_URL": redis_server.url,
           "ROLLOUT_STATE_DIR": str(state), "ROLLOUT_PORT": str(port)}
    env.pop("ROLLOUT_API_TOKEN", None)
    settings = Settings.from_env(env)
    running = Service(f"http://127.0.0.1:{port}", redis_server.url, state, Supervisor(state / "logs", env),
                      env, redis_server)
    try:
        running.supervisor.start("gateway", gateway_command(settings, bind="127.0.0.1"))
        for queue in WORKER_POOLS:
            running.supervisor.start(f"worker-{queue}", worker_command(settings, queue))
        wait_http(f"{running.url}/readyz", running.supervisor, 90)
        yield running
    finally:
        running.supervisor.stop()
        running.redis_server.stop()  # a test may have restarted it


@pytest.fixture(scope="session")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with running_service(tmp_path_factory.mktemp("service")) as running:
        yield running


@pytest.fixture
def client(service: Service) -> Iterator[RolloutClient]:
    with service.client() as c:
        yield c


@pytest.fixture
def scripted_backend(service: Service, scripted_server: Callable[..., str], tiny_tokenizer_dir: Path
                     ) -> Iterator[Callable[..., BackendView]]:
    """Start a scripted inference server and register it; removed again after the test."""
    registered: list[str] = []
    with service.client() as c:
        def make(script: dict, kind: str = "vllm", model: str = "scripted") -> BackendView:
            backend = c.add_backend(scripted_server(script), kind, model, tokenizer=str(tiny_tokenizer_dir))
            registered.append(backend.id)
            return backend

        yield make
        for backend_id in registered:
            with contextlib.suppress(ApiError):  # the test may have removed it itself
                c.remove_backend(backend_id)
