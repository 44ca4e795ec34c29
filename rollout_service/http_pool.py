"""Keep-alive HTTP/1.1 connections to inference servers, shared by every episode of a process.

A run worker makes one POST per LLM call to a handful of servers, from hundreds of threads or
greenlets at once. ``http.client`` on pooled keep-alive connections costs a fraction of a
general-purpose client's CPU per call (measured: ~0.2 ms vs ~0.7 ms with httpx), which is
most of the service's own time per turn at high concurrency.
"""
from __future__ import annotations

import http.client
import os
import socket
import threading
import time
from typing import Protocol
from urllib.parse import urlsplit

MAX_IDLE_PER_HOST = 4096  # above any sane run concurrency: a closed idle connection is a new connect later


class ConnectFailed(Exception):
    """The request never reached the server (refused, reset before an answer, DNS)."""


class ReadTimedOut(Exception):
    """The server took longer than the timeout to answer."""


class Transport(Protocol):
    def post_json(self, url: str, body: bytes, timeout_s: float, connect_timeout_s: float) -> tuple[int, bytes]:
        """POST ``body`` (JSON) to ``url``: (status, response body), or ConnectFailed / ReadTimedOut."""


ADDRESS_TTL_S = 30.0
_addresses: dict[tuple[str, int], tuple[float, tuple]] = {}


def resolved(host: str, port: int) -> tuple:
    """(family, type, proto, sockaddr) to reach host:port, resolved at most every ADDRESS_TTL_S.
    A green process resolves in a thread pool: a thousand first calls at once queued there."""
    now = time.monotonic()
    cached = _addresses.get((host, port))
    if cached is None or now - cached[0] > ADDRESS_TTL_S:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)[0]
        cached = _addresses[(host, port)] = (now, (family, kind, proto, sockaddr))
    return cached[1]


class _Connection(http.client.HTTPConnection):
    """An HTTP connection that connects to a cached address, with Nagle off (small JSON bodies)."""

    def connect(self) -> None:
        family, kind, proto, sockaddr = resolved(self.host, self.port)
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(self.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.connect(sockaddr)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class KeepAlivePool:
    """Idle connections per (scheme, host, port); a connection serves one request at a time."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, str, int], list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()

    def post_json(self, url: str, body: bytes, timeout_s: float, connect_timeout_s: float) -> tuple[int, bytes]:
        parts = urlsplit(url)
        key = (parts.scheme, parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80))
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        headers = {"Content-Type": "application/json", "Content-Length": str(len(body))}
        for attempt in range(2):
            connection, reused = self._take(key, connect_timeout_s)
            try:
                if connection.sock is None:
                    connection.connect()
                connection.sock.settimeout(timeout_s)
                connection.request("POST", path or "/", body=body, headers=headers)
                response = connection.getresponse()
                data = response.read()
            except (socket.timeout, TimeoutError) as exc:
                connection.close()
                raise ReadTimedOut(str(exc) or "timed out") from exc
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as exc:
                connection.close()
                if reused and attempt == 0:  # the server closed an idle keep-alive connection
                    continue
                raise ConnectFailed(f"{type(exc).__name__}: {exc}") from exc
            except (OSError, http.client.HTTPException) as exc:
                connection.close()
                raise ConnectFailed(f"{type(exc).__name__}: {exc}") from exc
            if response.will_close:
                connection.close()
            else:
                self._give_back(key, connection)
            return response.status, data
        raise AssertionError("unreachable")

    def _take(self, key: tuple[str, str, int], connect_timeout_s: float) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            idle = self._idle.get(key)
            if idle:
                return idle.pop(), True
        scheme, host, port = key
        factory = http.client.HTTPSConnection if scheme == "https" else _Connection
        return factory(host, port, timeout=connect_timeout_s), False

    def _give_back(self, key: tuple[str, str, int], connection: http.client.HTTPConnection) -> None:
        with self._lock:
            idle = self._idle.setdefault(key, [])
            if len(idle) < MAX_IDLE_PER_HOST:
                idle.append(connection)
                return
        connection.close()


_pool: KeepAlivePool | None = None
_pool_pid: int | None = None
_pool_lock = threading.Lock()


def shared_pool() -> KeepAlivePool:
    """The process's pool (a new one after a fork: sockets are not shared across processes)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool, _pool_pid = KeepAlivePool(), os.getpid()
        return _pool
