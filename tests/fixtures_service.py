"""The whole service for end-to-end tests: its own redis-server, the gateway under gunicorn,
and one real Celery worker per queue, each a separate process, as `rollout-service up` runs them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rollout_service.devtools.local_service import LocalService, local_service
from rollout_service.errors import ApiError
from rollout_service.schemas import BackendView
from rollout_service.sdk.client import RolloutClient

SERVICE_SETTINGS = {
    "ROLLOUT_GATEWAY_WORKERS": "2",
    "ROLLOUT_RUN_CONCURRENCY": "8",
    "ROLLOUT_EVAL_CONCURRENCY": "2",
    "ROLLOUT_INIT_CONCURRENCY": "2",
    "ROLLOUT_LEASE_TTL_S": "10",
    "ROLLOUT_LLM_CONNECT_RETRIES": "1",
    "ROLLOUT_BACKEND_OUTAGE_WAIT_S": "10",  # jobs of a dead backend wait this long for it: tests' dead urls fail soon
}


Service = LocalService


def running_service(state: Path, **settings_env: str) -> contextlib.AbstractContextManager[Service]:
    return local_service(state, **{**SERVICE_SETTINGS, **settings_env})


@pytest.fixture(scope="session")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with running_service(tmp_path_factory.mktemp("service")) as running:
        yield running


@pytest.fixture
def client(service: Service) -> Iterator[RolloutClient]:
    with service.client() as c:
        yield c


@pytest.fixture
def scripted_backend(
    service: Service, scripted_server: Callable[..., str], tiny_tokenizer_dir: Path
) -> Iterator[Callable[..., BackendView]]:
    """Start a scripted inference server and register it; removed again after the test."""
    registered: list[str] = []
    with service.client() as c:

        def make(script: dict, kind: str = "vllm", model: str = "scripted", *server_args: str) -> BackendView:
            backend = c.add_backend(
                scripted_server(script, *server_args), kind, model, tokenizer=str(tiny_tokenizer_dir)
            )
            registered.append(backend.id)
            return backend

        yield make
        for backend_id in registered:
            with contextlib.suppress(ApiError):  # the test may have removed it itself
                c.remove_backend(backend_id)
