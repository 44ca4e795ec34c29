"""Shared fixtures: a real redis-server per test session, flushed between tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from rollout_service.devtools.redis_server import RedisServer

pytest_plugins = [
    "tests.fixtures_service",
    "tests.fixtures_tokens",
    "tests.fixtures_slurm",
    "tests.fixtures_celery",
    "tests.fixtures_images",
    "tests.fixtures_swe",
]


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"), appendonly=False).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    yield client
    client.close()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start building the SWE-bench images now if a collected test uses them (overlaps other tests)."""
    uses = any("swe_images" in getattr(item, "fixturenames", ()) for item in session.items)
    if uses and not session.config.option.collectonly:
        from tests.fixtures_swe import start_swe_image_build

        start_swe_image_build()
