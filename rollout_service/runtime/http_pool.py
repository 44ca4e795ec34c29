"""Keep-alive HTTP/1.1 connections to inference servers, shared by every episode of a process.

A run worker makes one POST per LLM call to a handful of servers, from hundreds of threads or
greenlets at once. Plain ``http://`` servers (vLLM, SGLang) get a minimal HTTP/1.1 exchange: the
request in one ``send``, the answer read into one buffer, its headers split by hand, which skips
``http.client``'s status and header parsing (the ``email`` package), a large share of a run
worker's CPU when it holds many episodes. ``https://`` goes through ``http.client``.
"""

from __future__ import annotations

import _socket
import errno
import http.client
import os
import select
import socket
import threading
import time
from typing import Protocol
from urllib.parse import urlsplit

from rollout_service.concurrency.green import wait_ready

MAX_IDLE_PER_HOST = 4096  # above any sane run concurrency: a closed idle connection is a new connect later


class ConnectFailed(Exception):
    """The request never reached the server (refused, reset before an answer, DNS)."""


class ReadTimedOut(Exception):
    """The server took longer than the timeout to answer."""


class Aborted(Exception):
    """The request was aborted by its ``Abort`` handle (its connection closed under it)."""


class Abort:
    """A handle to abort one request from another thread or greenlet: its connection is shut down,
    which ends the wait for the answer at once and tells the server its client left."""

    __slots__ = ("requested", "sock")

    def __init__(self) -> None:
        self.requested = False
        self.sock: socket.socket | None = None

    def abort(self) -> None:
        self.requested = True
        sock = self.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class Transport(Protocol):
    def post_json(
        self, url: str, body: bytes, timeout_s: float, connect_timeout_s: float, abort: Abort | None = None
    ) -> tuple[int, bytes]:
        """POST ``body`` (JSON) to ``url``: (status, response body), or ConnectFailed / ReadTimedOut /
        Aborted."""


ADDRESS_TTL_S = 30.0
_addresses: dict[tuple[str, int], tuple[float, tuple]] = {}


def resolved(host: str, port: int) -> tuple:
    """(family, type, proto, sockaddr) to reach host:port, resolved at most every ADDRESS_TTL_S.
    A green process resolves in a thread pool, where the first calls of many episodes starting at
    once would queue."""
    now = time.monotonic()
    cached = _addresses.get((host, port))
    if cached is None or now - cached[0] > ADDRESS_TTL_S:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)[0]
        cached = _addresses[(host, port)] = (now, (family, kind, proto, sockaddr))
    return cached[1]


class ProtocolError(Exception):
    """The server's answer is not HTTP/1.x as this client reads it."""


class _PlainConnection:
    """One keep-alive HTTP/1.1 connection for requests with a JSON body and a buffered answer
    (Content-Length, chunked, or read to the close)."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self.sock: socket.socket | None = None
        self._host_header = f"{host}:{port}".encode()

    def connect(self) -> None:
        """Connect without handing the CPU over where the connection is made at once (a server on
        this host: the handshake completes inside the first ``connect``). A green worker waiting
        for it would first run every other ready episode, delaying the first call of every
        episode of a step that starts at once."""
        family, kind, proto, sockaddr = resolved(self.host, self.port)
        raw = _socket.socket(family, kind, proto)  # the C type, which gevent does not patch
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            raw.setblocking(False)
            status = raw.connect_ex(sockaddr)
            if status in (errno.EINPROGRESS, errno.EAGAIN):
                status = raw.connect_ex(sockaddr)  # 0 once the handshake is done
        except BaseException:
            raw.close()
            raise
        sock = socket.socket(family, kind, proto, fileno=raw.detach())
        try:
            if status in (errno.EINPROGRESS, errno.EALREADY, errno.EAGAIN):
                if not wait_ready(sock, self.timeout, select.POLLOUT):
                    raise TimeoutError(f"connecting to {self.host}:{self.port} timed out")
                status = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if status not in (0, errno.EISCONN):
                raise OSError(status, os.strerror(status))
            sock.settimeout(self.timeout)
        except BaseException:
            sock.close()
            raise
        self.sock = sock

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def post(self, path: str, body: bytes) -> tuple[int, bytes, bool]:
        """(status, body, whether the server keeps the connection open)."""
        assert self.sock is not None
        request = b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
            path.encode(),
            self._host_header,
            len(body),
            body,
        )
        sent = self.sock.send(request)  # a request fits the socket's buffer: one system call (sendall makes two)
        if sent < len(request):
            self.sock.sendall(memoryview(request)[sent:])
        buffer = b""
        while True:
            head_end = buffer.find(b"\r\n\r\n")
            if head_end < 0:
                buffer = self._more(buffer, answered=bool(buffer))
                continue
            status_line, *header_lines = buffer[:head_end].decode("latin-1").split("\r\n")
            buffer = buffer[head_end + 4 :]
            version, status = self._status(status_line)
            if 100 <= status < 200:  # an interim answer: the real one follows
                continue
            headers = {}
            for line in header_lines:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            keep_alive = headers.get("connection", "").lower() != "close" and (
                version == "HTTP/1.1" or headers.get("connection", "").lower() == "keep-alive"
            )
            if "chunked" in headers.get("transfer-encoding", "").lower():
                data, buffer = self._chunked(buffer)
            elif "content-length" in headers:
                length = int(headers["content-length"])
                while len(buffer) < length:
                    buffer = self._more(buffer)
                data, buffer = buffer[:length], buffer[length:]
            elif status in (204, 304):
                data = b""
            else:  # the body ends when the server closes
                data, keep_alive = self._until_closed(buffer), False
                buffer = b""
            return status, data, keep_alive and not buffer

    @staticmethod
    def _status(line: str) -> tuple[str, int]:
        version, _, rest = line.partition(" ")
        if not version.startswith("HTTP/1.") or not rest[:3].isdigit():
            raise ProtocolError(f"not an HTTP/1.x status line: {line[:100]!r}")
        return version, int(rest[:3])

    def _more(self, buffer: bytes, answered: bool = True) -> bytes:
        """``buffer`` and what arrives next. A close before any answer is a reset (a reused idle
        connection the server dropped is sent again); a close mid-answer is not."""
        assert self.sock is not None
        chunk = self.sock.recv(65536)
        if not chunk:
            if not answered:
                raise ConnectionResetError("the server closed the connection without answering")
            raise ProtocolError("the server closed the connection mid-answer")
        return buffer + chunk

    def _chunked(self, buffer: bytes) -> tuple[bytes, bytes]:
        parts: list[bytes] = []
        while True:
            while (line_end := buffer.find(b"\r\n")) < 0:
                buffer = self._more(buffer)
            size = int(buffer[:line_end].split(b";", 1)[0], 16)
            buffer = buffer[line_end + 2 :]
            if size == 0:  # the last chunk, then trailers up to an empty line
                while (trailers_end := buffer.find(b"\r\n")) != 0:
                    if trailers_end > 0:
                        buffer = buffer[trailers_end + 2 :]
                    else:
                        buffer = self._more(buffer)
                return b"".join(parts), buffer[2:]
            while len(buffer) < size + 2:
                buffer = self._more(buffer)
            parts.append(buffer[:size])
            buffer = buffer[size + 2 :]

    def _until_closed(self, buffer: bytes) -> bytes:
        assert self.sock is not None
        parts = [buffer]
        while chunk := self.sock.recv(65536):
            parts.append(chunk)
        return b"".join(parts)


Connection = _PlainConnection | http.client.HTTPConnection


class KeepAlivePool:
    """Idle connections per (scheme, host, port); a connection serves one request at a time."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, str, int], list[Connection]] = {}
        self._lock = threading.Lock()

    def post_json(
        self, url: str, body: bytes, timeout_s: float, connect_timeout_s: float, abort: Abort | None = None
    ) -> tuple[int, bytes]:
        parts = urlsplit(url)
        key = (parts.scheme, parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80))
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        for attempt in range(2):
            connection, reused = self._take(key, connect_timeout_s)
            try:
                if connection.sock is None:
                    connection.connect()
                assert connection.sock is not None
                connection.sock.settimeout(timeout_s)
                if abort is not None:
                    abort.sock = connection.sock
                    if abort.requested:
                        raise Aborted("aborted before it was sent")
                status, data, keep_alive = self._exchange(connection, path, body)
            except BaseException as exc:
                connection.close()
                if abort is not None and abort.requested:
                    raise Aborted(f"aborted ({type(exc).__name__}: {exc})") from exc
                if isinstance(exc, (socket.timeout, TimeoutError)):
                    raise ReadTimedOut(str(exc) or "timed out") from exc
                if isinstance(exc, (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)):
                    if reused and attempt == 0:  # the server closed an idle keep-alive connection
                        continue
                    raise ConnectFailed(f"{type(exc).__name__}: {exc}") from exc
                if isinstance(exc, (OSError, ValueError, ProtocolError, http.client.HTTPException)):
                    raise ConnectFailed(f"{type(exc).__name__}: {exc}") from exc
                raise
            finally:
                if abort is not None:
                    abort.sock = None
            if keep_alive:
                self._give_back(key, connection)
            else:
                connection.close()
            return status, data
        raise AssertionError("unreachable")

    @staticmethod
    def _exchange(
        connection: _PlainConnection | http.client.HTTPConnection, path: str, body: bytes
    ) -> tuple[int, bytes, bool]:
        if isinstance(connection, _PlainConnection):
            return connection.post(path, body)
        connection.request(
            "POST", path, body=body, headers={"Content-Type": "application/json", "Content-Length": str(len(body))}
        )
        response = connection.getresponse()
        data = response.read()
        return response.status, data, not response.will_close

    def _take(self, key: tuple[str, str, int], connect_timeout_s: float) -> tuple[Connection, bool]:
        with self._lock:
            idle = self._idle.get(key)
            if idle:
                return idle.pop(), True
        scheme, host, port = key
        factory = http.client.HTTPSConnection if scheme == "https" else _PlainConnection
        return factory(host, port, timeout=connect_timeout_s), False

    def _give_back(self, key: tuple[str, str, int], connection: Connection) -> None:
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
