"""The service's Redis clients: what ROLLOUT_REDIS_URL may name."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import redis

from rollout_service.devtools.redis_server import RedisServer
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


def test_a_workers_client_waits_out_a_redis_restart_and_the_gateways_gives_up_at_once(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis").start()
    settings = Settings(redis_url=server.url, redis_outage_wait_s=30, redis_retries=1)
    worker, gateway = redis_client(settings, ride_out_outages=True), redis_client(settings)
    gateway_gave_up = threading.Event()
    back = threading.Thread(target=lambda: (gateway_gave_up.wait(30), time.sleep(1.0), server.start()), daemon=True)
    try:
        worker.set("kept", "1")
        assert server.process is not None
        server.process.kill()
        server.process.wait()
        back.start()
        for client in (worker, gateway):
            client.connection_pool.disconnect()  # the next command connects: refused while Redis is down
        with pytest.raises(redis.ConnectionError):
            gateway.get("kept")
        gateway_gave_up.set()
        began = time.monotonic()
        assert worker.get("kept") == b"1", "the AOF brought it back"
        assert time.monotonic() - began > 0.5, "it was answered only after the restart"
    finally:
        gateway_gave_up.set()
        if back.ident is not None:
            back.join(30)
        server.stop()
