"""The service's Redis clients: what ROLLOUT_REDIS_URL may name."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from rollout_service.settings import Settings
from rollout_service.state.connection import redis_client


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs the redis-server binary")
def test_a_redis_on_a_unix_socket_serves_the_store(tmp_path: Path) -> None:
    socket_path = tmp_path / "redis.sock"
    server = subprocess.Popen(
        ["redis-server", "--port", "0", "--unixsocket", str(socket_path), "--save", "", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while not socket_path.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        client = redis_client(Settings(redis_url=f"unix://{socket_path}?db=0"))
        client.set("answer", "42")
        assert client.get("answer") == b"42"
    finally:
        server.terminate()
        server.wait(5)
