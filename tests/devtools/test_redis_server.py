"""The embedded Redis is private to the service: a password, no reconfiguration, private files."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from rollout_service.devtools.redis_server import RedisServer


@pytest.fixture
def private_redis(tmp_path: Path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


def test_a_local_user_without_the_password_is_refused(private_redis: RedisServer):
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=private_redis.port).get("rollout:job:anything")
    assert redis.Redis.from_url(private_redis.url).ping()


def test_commands_that_reconfigure_or_wipe_the_server_are_disabled(private_redis: RedisServer):
    client = redis.Redis.from_url(private_redis.url)
    for command in (("CONFIG", "SET", "dir", "/tmp"), ("FLUSHALL",), ("DEBUG", "SLEEP", "0"), ("SHUTDOWN",)):
        with pytest.raises(redis.ResponseError, match="unknown command"):
            client.execute_command(*command)


def test_the_password_is_in_no_command_line_and_every_file_is_private(private_redis: RedisServer):
    client = redis.Redis.from_url(private_redis.url)
    client.set("ground-truth", "42")
    time.sleep(1.2)  # appendfsync everysec
    assert private_redis.password not in Path(f"/proc/{private_redis.process.pid}/cmdline").read_text()
    assert private_redis.data_dir.stat().st_mode & 0o777 == 0o700
    files = [p for p in private_redis.data_dir.rglob("*")]
    assert any(p.name.endswith(".aof") for p in files)
    assert {oct(p.stat().st_mode & 0o777) for p in files if p.is_file()} == {"0o600"}


def test_a_restarted_server_keeps_its_password(tmp_path: Path):
    first = RedisServer(tmp_path / "redis").start()
    url = first.url
    first.stop()
    second = RedisServer(tmp_path / "redis", port=first.port).start()
    try:
        assert second.url == url and redis.Redis.from_url(url).ping()
    finally:
        second.stop()
