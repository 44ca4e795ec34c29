"""What the state Redis's commands cost by themselves: record them, replay them in big pipelines.

``bench/scale.py --replay`` runs the service on a Redis of the bench's own with MONITOR allowed,
records every command the service sends it (commands run inside scripts are not recorded: their
script is, and replaying it runs them again), and afterwards replays the recorded commands into a
fresh Redis of the same configuration from one client in pipelines of ``batch`` commands.
The commands before the measured round rebuild its starting state; those of the round are
measured. The replay's CPU per turn is what the same commands cost a Redis kept busy (warm caches,
no wake-up per round trip): the stack's own figure minus this is what its round trips, its timing
and Redis's idle housekeeping add.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlparse

import redis

from rollout_service.devtools.redis_server import RedisServer

REPLAY_BATCH = 200
WINDOW_START, WINDOW_END = "bench:replay:window-start", "bench:replay:window-end"
NOT_REPLAYED = {b"AUTH", b"HELLO", b"CLIENT", b"INFO", b"ECHO", b"MONITOR", b"SUBSCRIBE", b"UNSUBSCRIBE", b"PSUBSCRIBE"}
BLOCKING = {b"BLPOP", b"BRPOP", b"BRPOPLPUSH", b"BLMOVE", b"BZPOPMIN", b"BZPOPMAX", b"XREAD", b"XREADGROUP"}
_LINE = re.compile(r"^\+[\d.]+ \[\d+ ([^\]]+)\] (.*)$")
_ESCAPES = {"\\": b"\\", '"': b'"', "n": b"\n", "r": b"\r", "t": b"\t", "a": b"\a", "b": b"\b"}


class Recorder:
    """MONITOR on ``url`` into ``path`` from now until ``stop``."""

    def __init__(self, url: str, path: Path) -> None:
        parsed = urlparse(url)
        self.path = path
        self.sock = socket.create_connection((parsed.hostname, parsed.port))
        password = parsed.password or ""
        self.sock.sendall(f"*2\r\n$4\r\nAUTH\r\n${len(password)}\r\n{password}\r\n*1\r\n$7\r\nMONITOR\r\n".encode())
        self.thread = threading.Thread(target=self._record, name="redis-monitor", daemon=True)
        self.thread.start()

    def _record(self) -> None:
        with open(self.path, "wb") as out:
            while data := self.sock.recv(1 << 20):
                out.write(data)

    def stop(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(10)


def mark(url: str, marker: str) -> None:
    """A marker in the recording (ECHO, not replayed)."""
    client = redis.Redis.from_url(url)
    try:
        client.echo(marker)
    finally:
        client.close()


def parse(path: Path) -> tuple[list[list[bytes]], int, int]:
    """The recorded commands sent by clients (not by scripts), and where the marked window starts and ends."""
    commands: list[list[bytes]] = []
    start = end = -1
    for line in path.read_bytes().decode("latin-1").split("\r\n"):
        match = _LINE.match(line)
        if match is None or match.group(1) == "lua":
            continue
        args = _arguments(match.group(2))
        if args[:1] == [b"ECHO"] and len(args) == 2:
            if args[1].decode() == WINDOW_START:
                start = len(commands) + 1
            elif args[1].decode() == WINDOW_END:
                end = len(commands)
        commands.append(args)
    if start < 0 or end < 0:
        raise RuntimeError(f"the recording {path} has no replay window markers")
    return commands, start, end


def _arguments(text: str) -> list[bytes]:
    """MONITOR's quoted, escaped arguments as bytes."""
    args, i = [], 0
    while (i := text.find('"', i)) >= 0:
        i += 1
        value = bytearray()
        while text[i] != '"':
            if text[i] == "\\":
                code = text[i + 1]
                if code == "x":
                    value.append(int(text[i + 2 : i + 4], 16))
                    i += 4
                    continue
                value += _ESCAPES.get(code, code.encode("latin-1"))
                i += 2
                continue
            value += text[i].encode("latin-1")
            i += 1
        args.append(bytes(value))
        i += 1
    return args


def command_stats(client: redis.Redis) -> dict[str, tuple[int, int]]:
    """command -> (calls, µs) so far, from INFO commandstats; ``cpu`` -> (0, µs of CPU the server's
    main thread used, from INFO cpu), ``reads`` -> (read events it processed: round trips, 0) and
    ``wakeups`` -> (times its main thread went to sleep and woke, from /proc on this machine, 0)."""
    stats, cpu, counts, server = (
        cast("dict[str, Any]", client.info(part)) for part in ("commandstats", "cpu", "stats", "server")
    )
    used_s = cpu["used_cpu_user_main_thread"] + cpu["used_cpu_sys_main_thread"]
    return {
        **{name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for name, v in stats.items()},
        "cpu": (0, int(used_s * 1e6)),
        "reads": (int(counts["total_reads_processed"]), 0),
        "wakeups": (_voluntary_switches(int(server["process_id"])), 0),
    }


def _voluntary_switches(pid: int) -> int:
    """How often the main thread of local process ``pid`` slept (0 when it is not on this machine)."""
    try:
        status = Path(f"/proc/{pid}/task/{pid}/status").read_text()
    except OSError:
        return 0
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("voluntary_ctxt_switches"))


SCRIPT_COMMANDS = ("evalsha", "eval", "evalsha_ro", "eval_ro", "fcall", "fcall_ro")


def redis_cost(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]], turns: int) -> dict[str, Any]:
    """Per turn between two ``command_stats``: commands (a script counts once, and so does each
    command it runs), µs of the server's CPU (its main thread: commands, scripts, client I/O,
    housekeeping), and every command by its commandstats µs (a script's µs include those of
    the commands it runs, which are also counted under their own names)."""
    delta = {
        name: (calls - before.get(name, (0, 0))[0], usec - before.get(name, (0, 0))[1])
        for name, (calls, usec) in after.items()
    }
    cpu_usec, reads, wakeups = delta.pop("cpu")[1], delta.pop("reads")[0], delta.pop("wakeups", (0, 0))[0]
    delta = {name: d for name, d in delta.items() if d[0] > 0 and name != "info"}
    top = sorted(delta.items(), key=lambda item: -item[1][1])
    return {
        "commands_per_turn": round(sum(c for c, _ in delta.values()) / turns, 2),
        "usec_per_turn": round(cpu_usec / turns, 2),
        "commandstats_usec_per_turn": round(sum(u for _, u in delta.values()) / turns, 2),
        "round_trips_per_turn": round(reads / turns, 2),
        "wakeups_per_turn": round(wakeups / turns, 2),
        "script_calls_per_turn": round(sum(delta.get(name, (0, 0))[0] for name in SCRIPT_COMMANDS) / turns, 2),
        "top": {name: {"calls": c, "usec": u} for name, (c, u) in top},
    }


def replay(
    path: Path, turns: int, repeats: int = 3, batch: int = REPLAY_BATCH, appendonly: bool = True
) -> dict[str, Any]:
    """Replay a recording into a fresh Redis ``repeats`` times in pipelines of ``batch`` commands:
    µs of its CPU per turn for the window's commands (the median, and each replay's), the
    commands by their µs (the median's)."""
    commands, start, end = parse(path)
    runs = sorted(
        (_replay_once(commands, start, end, turns, batch, appendonly) for _ in range(repeats)), key=lambda r: r[0]
    )
    usec, sent, top = runs[len(runs) // 2]
    return {
        "commands": sent,
        "batch": batch,
        "usec_per_turn": usec,
        "usec_per_turn_each": [run[0] for run in runs],
        "top": top,
    }


def _replay_once(
    commands: list[list[bytes]], start: int, end: int, turns: int, batch: int, appendonly: bool
) -> tuple[float, int, dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="bench-replay-") as tmp:
        server = RedisServer(Path(tmp), appendonly=appendonly).start()
        client = redis.Redis.from_url(server.url)
        try:
            _play(client, commands[:start], REPLAY_BATCH)
            before = command_stats(client)
            sent = _play(client, commands[start:end], batch)
            cost = redis_cost(before, command_stats(client), turns)
        finally:
            client.close()
            server.stop()
    return cost["usec_per_turn"], sent, dict(list(cost["top"].items())[:12])


def instructions(path: Path, turns: int, batch: int = REPLAY_BATCH) -> dict[str, Any]:
    """The window's commands replayed once into a Redis run under valgrind's callgrind: the
    instructions its process executed per turn (commands, scripts, client I/O, the AOF; no timing
    noise, no cache misses) and the functions with the most of them (inclusive)."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_annotate") is None:
        raise RuntimeError("--replay-instructions needs valgrind (apt-get install valgrind)")
    commands, start, end = parse(path)
    with tempfile.TemporaryDirectory(prefix="bench-callgrind-") as tmp:
        server = RedisServer(Path(tmp))
        out = Path(tmp) / "callgrind.out"
        process = server.launch(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *server.command()],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(server.url)
        try:
            server.wait_ready(120)
            _play(client, commands[:start], REPLAY_BATCH)
            time.sleep(1)  # the AOF's and the cron's catching up stay out of the window
            subprocess.run(["callgrind_control", "--zero", str(process.pid)], check=True, capture_output=True)
            _play(client, commands[start:end], batch)
            subprocess.run(["callgrind_control", "--dump", str(process.pid)], check=True, capture_output=True)
        finally:
            client.close()
            process.terminate()
            process.wait(60)
        dump = next(p for p in sorted(Path(tmp).glob("callgrind.out.*")) if p.stat().st_size)
        annotated = subprocess.run(
            ["callgrind_annotate", "--inclusive=yes", str(dump)], check=True, capture_output=True, text=True
        ).stdout
    total = int(re.search(r"([\d,]+) \(100.0%\)\s+PROGRAM TOTALS", annotated).group(1).replace(",", ""))  # type: ignore[union-attr]
    top = {
        name: int(count.replace(",", "")) // turns
        for count, name in re.findall(r"^\s*([\d,]+) \(\s*[\d.]+%\)\s+\?\?\?:(\w+) \[", annotated, re.M)
        if name in _COMMAND_PARTS
    }
    return {"instructions_per_turn": total // turns, "by_part": top}


# the server's functions whose inclusive instructions tell where a turn's go
_COMMAND_PARTS = (
    "evalShaCommand",
    "execCommand",
    "feedAppendOnlyFile",
    "readQueryFromClient",
    "processMultibulkBuffer",
    "hmgetCommand",
    "hsetCommand",
    "setCommand",
    "getCommand",
    "lpFind",
    "serverCron",
)


def _play(client: redis.Redis, commands: list[list[bytes]], batch: int) -> int:
    sent = 0
    pipe = client.pipeline(transaction=False)
    for args in commands:
        name = args[0].upper()
        if name in NOT_REPLAYED or name in BLOCKING:
            continue
        pipe.execute_command(*args)
        sent += 1
        if len(pipe.command_stack) >= batch:
            pipe.execute(raise_on_error=False)
    pipe.execute(raise_on_error=False)
    return sent
