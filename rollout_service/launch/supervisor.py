"""Keeps the service's processes alive, as an init system would: each piece is a child process in
its own session, logged to a file; one that dies is restarted with backoff (its leftover processes
killed first); only ``stop()`` ends them, in order: intake, workers, backends and monitoring, Redis."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from rollout_service.concurrency.priority import lower_priority
from rollout_service.errors import ConfigError

# stop order: what takes jobs in stops first, what the others need stops last
INTAKE, WORKERS, SERVICES, STORE = range(4)
FIRST_RESTART_DELAY_S = 0.5
MAX_RESTART_DELAY_S = 30.0
STABLE_AFTER_S = 60.0  # a child that ran this long starts its backoff afresh when it dies
STARTUP_DEATHS = 3  # a piece that dies this many times before the service was first ready is misconfigured


@dataclass
class Child:
    name: str
    command: list[str]
    stop_rank: int = WORKERS
    niceness: int = 0
    env: dict[str, str] | None = None  # beyond the supervisor's
    launch: Callable[..., subprocess.Popen] | None = None  # how to start it, if not a plain Popen
    ready: Callable[[], None] | None = None  # waited for after a restart
    log_path: Path | None = None  # where it logs, if not the supervisor's log file of its name
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    quick_deaths: int = 0
    restart_at: float | None = None  # set while a dead child waits for its restart
    exit_codes: list[int] = field(default_factory=list)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


class Supervisor:
    """Starts the pieces as separate processes, restarts those that die, stops them in order."""

    def __init__(
        self, log_dir: Path, env: dict[str, str], stop_grace_s: float = 15.0, report: TextIO | None = None
    ) -> None:
        self.log_dir = log_dir
        self.env = env
        self.stop_grace_s = stop_grace_s
        self.report = report
        self.children: list[Child] = []
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(
        self,
        name: str,
        command: list[str],
        niceness: int = 0,
        stop_rank: int = WORKERS,
        env: dict[str, str] | None = None,
    ) -> Child:
        child = Child(name, command, stop_rank, niceness, env)
        self._spawn(child)
        self.children.append(child)
        return child

    def adopt(
        self,
        name: str,
        process: subprocess.Popen,
        command: list[str],
        stop_rank: int,
        launch: Callable[..., subprocess.Popen],
        ready: Callable[[], None],
        log_path: Path | None = None,
    ) -> Child:
        """Supervise a process started elsewhere (the embedded Redis), restarted with ``launch``;
        ``log_path``: the log it writes itself."""
        child = Child(
            name,
            command,
            stop_rank,
            launch=launch,
            ready=ready,
            process=process,
            started_at=time.monotonic(),
            log_path=log_path,
        )
        self.children.append(child)
        return child

    def _spawn(self, child: Child) -> None:
        log = open(self.log_dir / f"{child.name}.log", "ab")
        try:
            if child.launch:
                child.process = child.launch(child.command, stdout=log, stderr=subprocess.STDOUT)
            else:
                niceness = child.niceness
                child.process = subprocess.Popen(
                    child.command,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**self.env, **(child.env or {})},
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    preexec_fn=(lambda: lower_priority(niceness)) if niceness else None,
                )
        finally:
            log.close()
        child.started_at = time.monotonic()

    def log_of(self, child: Child) -> Path:
        return child.log_path or self.log_dir / f"{child.name}.log"

    def log_tail(self, child: Child, chars: int = 3000) -> str:
        try:
            return self.log_of(child).read_text(errors="replace")[-chars:]
        except OSError as exc:
            return f"(no log: {exc})"

    def check(self) -> None:
        """While starting up: a piece that dies is restarted as later on; one that died
        STARTUP_DEATHS times before the service was ready is a configuration error, reported with
        its log."""
        self.watch()
        for child in self.children:
            if len(child.exit_codes) >= STARTUP_DEATHS:
                raise ConfigError(
                    f"{child.name} exited {len(child.exit_codes)} times while the service started (codes "
                    f"{child.exit_codes}); last lines of {self.log_of(child)}:\n{self.log_tail(child)}"
                )

    def watch(self) -> None:
        """Once running: restart every piece that died, after a backoff that grows while it keeps dying."""
        now = time.monotonic()
        for child in self.children:
            if child.restart_at is None and child.process is not None and child.process.poll() is not None:
                code = child.process.returncode
                child.exit_codes.append(code)
                _kill_group(child.process.pid)  # what it left behind: pool children, helpers
                child.quick_deaths = 0 if now - child.started_at >= STABLE_AFTER_S else child.quick_deaths + 1
                delay = min(FIRST_RESTART_DELAY_S * 2 ** max(child.quick_deaths - 1, 0), MAX_RESTART_DELAY_S)
                child.restart_at = now + delay
                self._say(
                    f"{child.name} exited with code {code}; restarting it in {delay:.1f} s (see {self.log_of(child)})"
                )
            if child.restart_at is not None and now >= child.restart_at:
                child.restart_at = None
                child.restarts += 1
                try:
                    self._spawn(child)
                    if child.ready:
                        child.ready()
                except Exception as exc:  # it is dead again: the next watch restarts it, later
                    self._say(f"{child.name} failed to restart: {exc}")
                    continue
                self._say(f"{child.name} restarted (restart {child.restarts})")

    def stop(self) -> None:
        """Stop every piece, rank by rank (intake, workers, backends and monitoring, store), each
        rank given ``stop_grace_s`` to finish before it is killed."""
        for rank in sorted({c.stop_rank for c in self.children}):
            group = [(c, c.process) for c in self.children if c.stop_rank == rank and c.process is not None]
            for child, process in group:
                child.restart_at = None
                if process.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGTERM)
            deadline = time.monotonic() + self.stop_grace_s
            for child, process in group:
                try:
                    process.wait(max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    self._say(f"{child.name} did not stop within {self.stop_grace_s:.0f} s; killing it")
                    _kill_group(process.pid)
                    process.wait()
                _kill_group(process.pid)

    def _say(self, message: str) -> None:
        if self.report is not None:
            print(message, file=self.report, flush=True)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
