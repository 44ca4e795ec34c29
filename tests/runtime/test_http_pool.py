"""The inference client's HTTP/1.1 exchange against a raw socket server that answers as told."""

from __future__ import annotations

import socket
import textwrap
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from rollout_service.runtime.http_pool import ConnectFailed, KeepAlivePool, ReadTimedOut
from tests.helpers import run_fresh

Answer = Callable[[socket.socket, bytes], bool]  # writes an answer; False: close the connection after


def read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    )
    while len(body) < length:
        body += conn.recv(65536)
    return body


@pytest.fixture
def raw_server() -> Iterator[tuple[str, list[Answer], list[int]]]:
    """(url, answers to give in turn, connections accepted so far)."""
    listener = socket.create_server(("127.0.0.1", 0))
    answers: list[Answer] = []
    accepted = [0]

    def serve(conn: socket.socket) -> None:
        with conn:
            while answers:
                body = read_request(conn)
                if not body or not answers.pop(0)(conn, body):
                    return

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepted[0] += 1
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}/v1/completions", answers, accepted
    listener.close()


def reply(raw: bytes, keep: bool = True) -> Answer:
    return lambda conn, body: (conn.sendall(raw), keep)[1]


def test_answers_by_length_by_chunks_and_by_close_all_read_whole(raw_server):
    url, answers, accepted = raw_server
    pool = KeepAlivePool()
    answers += [
        reply(b'HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\n{"a":1}'),
        reply(
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n"
            b'3;x=y\r\n{"b\r\n4\r\n":2}\r\n0\r\nX-Trailer: t\r\n\r\n'
        ),
        reply(b'HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n{"c":3}', keep=False),
    ]
    assert pool.post_json(url, b"{}", 5, 5) == (200, b'{"a":1}')
    assert pool.post_json(url, b"{}", 5, 5) == (201, b'{"b":2}')
    assert pool.post_json(url, b"{}", 5, 5) == (200, b'{"c":3}')
    assert accepted[0] == 1  # keep-alive until the HTTP/1.0 answer ended by its close


def test_a_request_body_arrives_whole_and_connection_close_is_honoured(raw_server):
    url, answers, accepted = raw_server
    seen: list[bytes] = []
    pool = KeepAlivePool()
    answers += [
        lambda conn, body: (
            seen.append(body),
            conn.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"),
            False,
        )[2]
    ] * 2
    big = b"[" + b",".join(b"%d" % i for i in range(50000)) + b"]"
    assert pool.post_json(url, big, 5, 5) == (200, b"ok")
    assert pool.post_json(url, b"{}", 5, 5) == (200, b"ok")
    assert seen == [big, b"{}"] and accepted[0] == 2


def test_an_idle_connection_the_server_dropped_is_replaced_but_a_half_answer_is_an_error(raw_server):
    url, answers, accepted = raw_server
    pool = KeepAlivePool()
    answers += [
        reply(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n1", keep=False),  # then closes, silently
        reply(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n2"),
        reply(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n123", keep=False),
    ]
    assert pool.post_json(url, b"{}", 5, 5) == (200, b"1")
    assert pool.post_json(url, b"{}", 5, 5) == (200, b"2")  # sent again on a new connection
    with pytest.raises(ConnectFailed, match="mid-answer"):
        pool.post_json(url, b"{}", 5, 5)
    assert accepted[0] == 2


def test_a_server_that_does_not_answer_in_time_is_a_read_timeout(raw_server):
    url, answers, _ = raw_server
    answers.append(lambda conn, body: (threading.Event().wait(2), False)[1])
    with pytest.raises(ReadTimedOut):
        KeepAlivePool().post_json(url, b"{}", 0.3, 5)


def test_garbage_instead_of_http_is_a_connect_failure():
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            read_request(conn)
            conn.sendall(b"SSH-2.0-OpenSSH\r\n\r\n")

    threading.Thread(target=serve, daemon=True).start()
    with pytest.raises(ConnectFailed, match="not an HTTP"):
        KeepAlivePool().post_json(f"http://127.0.0.1:{listener.getsockname()[1]}/", b"{}", 5, 5)
    listener.close()


def test_a_closed_port_is_a_connect_failure():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()
    with pytest.raises(ConnectFailed, match="ConnectionRefused|Errno 111"):
        KeepAlivePool().post_json(f"http://127.0.0.1:{port}/", b"{}", 5, 5)


def test_in_a_green_worker_a_local_connect_does_not_hand_the_cpu_to_other_episodes():
    script = textwrap.dedent("""
        from gevent import monkey; monkey.patch_all()
        import gevent, json, socket
        from rollout_service.runtime.http_pool import _PlainConnection, resolved
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]

        def serve():
            conn, _ = listener.accept()
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: 2\\r\\n\\r\\nok")

        gevent.spawn(serve)
        resolved("127.0.0.1", port)  # a name is resolved in a thread pool, once per 30 s
        gevent.sleep(0)
        ran = []
        gevent.spawn(ran.append, "another episode")
        connection = _PlainConnection("127.0.0.1", port, 5)
        connection.connect()
        before = list(ran)
        answer = connection.post("/", b"{}")
        print(json.dumps({"before": before, "answer": [answer[0], answer[1].decode()], "after": ran}))
    """)
    result = run_fresh(script)
    assert result["before"] == []
    assert result["answer"] == [200, "ok"]
    assert result["after"] == ["another episode"]


def test_a_server_whose_backlog_is_full_times_out_after_the_connect_timeout():
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    port = listener.getsockname()[1]
    waiting = []
    for _ in range(4):  # fill the accept queue: further handshakes stay in progress
        queued = socket.socket()
        queued.setblocking(False)
        queued.connect_ex(("127.0.0.1", port))
        waiting.append(queued)
    started = time.monotonic()
    with pytest.raises(ReadTimedOut, match="connecting to"):
        KeepAlivePool().post_json(f"http://127.0.0.1:{port}/", b"{}", 5, 0.3)
    assert 0.25 < time.monotonic() - started < 3
    for queued in waiting:
        queued.close()
    listener.close()
