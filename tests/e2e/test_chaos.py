"""Faults under load, as an operator meets them: pieces of `rollout-service up` killed with
SIGKILL while 200 jobs run in bwrap sandboxes, and the service restarting each."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from rollout_service.devtools.redis_server import free_port
from rollout_service.errors import DeadlineExceeded
from rollout_service.schemas import JobView
from rollout_service.sdk.client import RolloutClient
from tests.helpers import math_task, processes_with, server_log, tool_call, wait_for

JOBS = 200
TOKEN = "chaos-token"
TERMINAL = {"completed", "failed", "cancelled", "timed_out"}


@dataclass
class Up:
    process: subprocess.Popen
    gateway: str
    flower: str
    state: Path
    lines: list[str] = field(default_factory=list)

    def said(self, text: str) -> bool:
        return any(text in line for line in self.lines)

    def output(self) -> str:
        return "".join(self.lines)


@contextlib.contextmanager
def rollout_service_up(state: Path, start_timeout_s: float = 180, **settings: str) -> Iterator[Up]:
    """`rollout-service up --no-reference` as a user starts it; stopped with Ctrl-C at the end."""
    port, flower_port = free_port(), free_port()
    env = {
        **os.environ,
        "ROLLOUT_STATE_DIR": str(state),
        "ROLLOUT_PORT": str(port),
        "ROLLOUT_FLOWER_PORT": str(flower_port),
        "ROLLOUT_API_TOKEN": TOKEN,
        **settings,
    }
    env.pop("ROLLOUT_REDIS_URL", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "rollout_service.cli", "up", "--no-reference"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    up = Up(process, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{flower_port}", state)
    reader = threading.Thread(target=lambda: up.lines.extend(iter(process.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        wait_for(lambda: up.said("rollout-service is up") or process.poll() is not None, start_timeout_s, "up to start")
        assert process.poll() is None, up.output()
        yield up
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(120)
        reader.join(5)


def main_pid(state: Path, marker: bytes) -> int:
    """The pid of the piece of ``up`` whose command line holds ``marker`` (a child of ``up``)."""
    ups = {
        pid
        for pid in processes_with(f"ROLLOUT_STATE_DIR={state}")
        if b"rollout_service.cli\0up" in Path(f"/proc/{pid}/cmdline").read_bytes()
    }
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError):
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent in ups and marker in (proc / "cmdline").read_bytes():
                return int(proc.name)
    raise AssertionError(f"no process of {state} runs {marker!r}")


STAGE_OF_STATUS = {"queued": "(queued)", "initializing": "init", "running": "run", "evaluating": "eval"}
BUDGET_S = 240  # every wait of the test from start-up on; its stop and checks fit in the rest of its 300 s


class Budget:
    """What is left of the test's time; each wait takes what it needs from it."""

    def __init__(self, total_s: float) -> None:
        self.end = time.monotonic() + total_s

    def left(self) -> float:
        return max(self.end - time.monotonic(), 1.0)


def views_when_all_ended(client: RolloutClient, job_ids: list[str], budget: Budget) -> list[JobView]:
    """Every job's view once all have ended (the client rides out the gateway's 503s while Redis
    restarts); else a failure naming each unfinished job's status, stage and deliveries."""
    try:
        return client.wait(job_ids, timeout_s=budget.left())
    except DeadlineExceeded:
        views = [client.get(job_id) for job_id in job_ids]
        stuck = [
            (v.job_id, v.status.value, STAGE_OF_STATUS.get(v.status.value), f"attempts={v.attempts}")
            for v in views
            if v.status.value not in TERMINAL
        ]
        raise AssertionError(f"{len(stuck)} jobs never ended: {stuck}") from None


def unfinished(client: RolloutClient, job_ids: list[str]) -> int:
    return sum(client.get(job_id).status.value not in TERMINAL for job_id in job_ids)


def kill_redis(up: Up, state: Path, budget: Budget, restarts: int) -> None:
    os.kill(main_pid(state, b"redis-server"), signal.SIGKILL)
    wait_for(lambda: up.said(f"redis restarted (restart {restarts})"), budget.left(), f"Redis's restart {restarts}")


def sandbox_processes(scratch: Path) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if proc.name.isdigit() and str(scratch).encode() in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
    return found


def test_up_restarts_a_killed_run_worker_eval_worker_and_redis_and_every_job_completes_once(
    tmp_path: Path, scripted_server: Callable[..., str], tiny_tokenizer_dir: Path
) -> None:
    problem = f"Chaos ({uuid.uuid4().hex[:6]})"
    steps = [{"text": tool_call("bash", command=f"echo step {i}"), "delay_s": 1.0} for i in range(3)]
    backend_url = scripted_server(
        {"episodes": [{"match": problem, "turns": [*steps, tool_call("finish", answer="\\boxed{4}")]}]}
    )
    scratch = Path(tempfile.mkdtemp(prefix="chaos-", dir="/tmp"))  # sockets in it: paths of <= 107 bytes
    state = tmp_path / "state"
    budget = Budget(BUDGET_S)
    with (
        rollout_service_up(
            state,
            budget.left(),
            ROLLOUT_RUN_WORKERS="2",
            ROLLOUT_LEASE_TTL_S="3",
            ROLLOUT_BACKEND_PROBE_INTERVAL_S="1",
            ROLLOUT_SCORE_IN_RUN="0",
            ROLLOUT_SANDBOX_SCRATCH_DIR=str(scratch),
            ROLLOUT_GATEWAY_WORKERS="1",
            ROLLOUT_SHUTDOWN_GRACE_S="10",
        ) as up,
        RolloutClient(up.gateway, token=TOKEN, timeout_s=60) as client,
    ):
        assert httpx.get(f"{up.flower}/api/workers").status_code == 401  # the API token guards Flower too
        assert httpx.get(f"{up.flower}/api/workers", auth=("rollout", TOKEN)).status_code == 200
        client.add_backend(backend_url, "vllm", "chaos", tokenizer=str(tiny_tokenizer_dir))
        job_ids = client.submit(math_task(problem), n=JOBS, agent={"tools": ["bash", "finish"]}).job_ids

        wait_for(lambda: len(server_log(backend_url)) >= JOBS // 2, budget.left(), "half the episodes to be under way")
        in_flight_at_kills = [unfinished(client, job_ids)]
        os.kill(main_pid(state, b"-Q\0run"), signal.SIGKILL)
        wait_for(
            lambda: up.said("worker-run-1 restarted") or up.said("worker-run-2 restarted"),
            budget.left(),
            "the run worker's restart",
        )
        in_flight_at_kills.append(unfinished(client, job_ids))  # episodes mid-turn, redelivered stages beginning
        kill_redis(up, state, budget, restarts=1)
        wait_for(
            lambda: any(client.get(j).status.value in ("evaluating", "completed") for j in job_ids[::10]),
            budget.left(),
            "grading to begin",
        )
        in_flight_at_kills.append(unfinished(client, job_ids))
        os.kill(main_pid(state, b"-Q\0eval"), signal.SIGKILL)
        wait_for(lambda: up.said("worker-eval restarted"), budget.left(), "the eval worker's restart")
        in_flight_at_kills.append(unfinished(client, job_ids))  # grading, stage ends and hand-offs
        kill_redis(up, state, budget, restarts=2)

        views = views_when_all_ended(client, job_ids, budget)
        trajectories = client.trajectories(job_ids)
    output = up.output()
    assert up.process.returncode == 0, output
    assert Counter(v.status.value for v in views) == {"completed": JOBS}, [
        (v.job_id, v.status.value, v.error) for v in views if v.status.value != "completed"
    ]
    assert all(v.reward == 1.0 for v in views)
    assert all(in_flight_at_kills), in_flight_at_kills  # each piece died with jobs in flight
    assert any(v.attempts > 1 for v in views)  # the killed run worker's episodes ran again
    assert len({v.job_id for v in views}) == JOBS
    for job_id in job_ids:
        turns = trajectories[job_id].turns
        assert [t.kind for t in turns].count("generation") == 4, (job_id, turns)  # one episode, not two spliced
    assert processes_with(f"ROLLOUT_STATE_DIR={state}") == []
    assert sandbox_processes(scratch) == []
    assert list(scratch.iterdir()) == []
    shutil.rmtree(scratch)
