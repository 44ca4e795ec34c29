"""The supervisor behind `rollout-service up`: a dead piece is restarted, not an outage; a stop goes in order."""

from __future__ import annotations

import io
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import redis

from rollout_service.devtools.redis_server import RedisServer
from rollout_service.errors import ConfigError
from rollout_service.launch.supervisor import INTAKE, SERVICES, STORE, WORKERS, Child, Supervisor
from tests.helpers import wait_for

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def watch_until(supervisor: Supervisor, condition, what: str, timeout_s: float = 20.0) -> None:
    def watched() -> bool:
        supervisor.watch()
        return condition()

    wait_for(watched, timeout_s, what)


def test_a_killed_piece_is_restarted_with_what_it_left_behind_killed_and_the_restart_is_reported(tmp_path: Path):
    report = io.StringIO()
    supervisor = Supervisor(tmp_path / "logs", dict(os.environ), report=report)
    spawner = [
        sys.executable,
        "-c",
        "import subprocess, sys, time; "
        "print(subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']).pid, flush=True); "
        "time.sleep(600)",
    ]
    worker = supervisor.start("worker-run-1", spawner)
    other = supervisor.start("worker-eval", SLEEPER)
    try:
        wait_for(lambda: (tmp_path / "logs" / "worker-run-1.log").read_text().strip(), 20, "the helper's pid")
        first, helper = worker.process.pid, int((tmp_path / "logs" / "worker-run-1.log").read_text().split()[0])
        os.kill(first, signal.SIGKILL)
        watch_until(supervisor, lambda: worker.alive() and worker.process.pid != first, "the restart")
        assert not Path(f"/proc/{helper}").exists() or "Z" in Path(f"/proc/{helper}/stat").read_text().split()[2]
        assert other.alive() and other.restarts == 0
        assert worker.restarts == 1 and worker.exit_codes == [-signal.SIGKILL]
        assert "worker-run-1 exited with code -9; restarting it in 0.5 s" in report.getvalue()
        assert "worker-run-1 restarted (restart 1)" in report.getvalue()
    finally:
        supervisor.stop()


def test_a_piece_that_keeps_dying_waits_longer_before_each_restart(tmp_path: Path):
    report = io.StringIO()
    supervisor = Supervisor(tmp_path / "logs", dict(os.environ), report=report)
    crasher = supervisor.start("flower", [sys.executable, "-c", "raise SystemExit(3)"], stop_rank=SERVICES)
    try:
        watch_until(supervisor, lambda: crasher.restarts >= 3, "three restarts")
        delays = [
            line.split("restarting it in ")[1].split(" s")[0]
            for line in report.getvalue().splitlines()
            if "restarting it in" in line
        ]
        assert delays[:3] == ["0.5", "1.0", "2.0"]
        assert set(crasher.exit_codes) == {3}
    finally:
        supervisor.stop()


def test_a_killed_redis_comes_back_on_its_port_with_its_data(tmp_path: Path):
    server = RedisServer(tmp_path / "redis").start()
    supervisor = Supervisor(tmp_path / "logs", dict(os.environ), report=io.StringIO())
    child = supervisor.adopt(
        "redis", server.process, list(server.process.args), STORE, launch=server.launch, ready=server.wait_ready
    )
    client = redis.Redis.from_url(server.url)
    try:
        client.set("accepted", "kept")
        time.sleep(1.2)  # appendfsync everysec
        os.kill(server.process.pid, signal.SIGKILL)
        watch_until(supervisor, lambda: child.restarts == 1 and child.alive(), "Redis's restart")
        assert client.get("accepted") == b"kept"
    finally:
        client.close()
        supervisor.stop()


def test_stop_ends_intake_first_then_workers_then_services_then_the_store(tmp_path: Path):
    supervisor = Supervisor(tmp_path / "logs", dict(os.environ), stop_grace_s=5)
    records = tmp_path / "order"
    ranks = {"redis": STORE, "reference": SERVICES, "worker-run": WORKERS, "gateway": INTAKE}
    for name, rank in ranks.items():  # started in the opposite order: the stop must not follow the start
        supervisor.start(
            name,
            [
                sys.executable,
                "-c",
                "import signal, sys, time\n"
                f"def stop(*_):\n    open({str(records)!r}, 'a').write({name!r} + '\\n'); sys.exit(0)\n"
                "signal.signal(signal.SIGTERM, stop)\n"
                "print('ready', flush=True)\n"
                "time.sleep(600)",
            ],
            stop_rank=rank,
        )
    for name in ranks:
        log = tmp_path / "logs" / f"{name}.log"
        wait_for(lambda log=log: "ready" in log.read_text(), 20, f"{name} to start")
    supervisor.stop()
    assert records.read_text().split() == ["gateway", "worker-run", "reference", "redis"]
    assert all(child.process.poll() is not None for child in supervisor.children)


def test_a_piece_that_dies_while_the_service_starts_is_restarted_and_one_that_keeps_dying_stops_start_up_with_its_log(
    tmp_path: Path,
):
    server = RedisServer(tmp_path / "redis").start()
    supervisor = Supervisor(tmp_path / "logs", dict(os.environ), report=io.StringIO())
    store = supervisor.adopt(
        "redis",
        server.process,
        list(server.process.args),
        STORE,
        launch=server.launch,
        ready=server.wait_ready,
        log_path=tmp_path / "redis" / "redis.log",
    )
    supervisor.start("flower", [sys.executable, "-c", "print('bad flag'); raise SystemExit(3)"])
    try:
        os.kill(server.process.pid, signal.SIGKILL)
        with pytest.raises(ConfigError) as stopped:
            wait_for(lambda: supervisor.check() or False, 30, "start-up to give up on the crashing piece")
        assert "flower exited 3 times while the service started (codes [3, 3, 3])" in str(stopped.value)
        assert "bad flag" in str(stopped.value)
        assert store.restarts >= 1 and store.alive(), "the killed Redis came back meanwhile"
        assert supervisor.log_tail(Child("vllm", SLEEPER, log_path=tmp_path / "gone.log")).startswith("(no log:")
    finally:
        supervisor.stop()
