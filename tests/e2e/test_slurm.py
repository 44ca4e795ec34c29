"""The real slurm/*.sbatch scripts under a single-node Slurm: the control job's Redis takes only
its generated password, worker jobs (bwrap sandboxes) serve jobs submitted through the gateway,
a cancelled worker job loses nothing once another starts, and a worker job told to stop finishes
what it runs and hands back what it reserved."""

from __future__ import annotations

import json
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis

from rollout_service.sdk.client import RolloutClient
from tests.fixtures_slurm import SLURM_DIR, ControlJob, SlurmCluster, job_processes, start_control

BROKER_QUEUES = ("init", "run", "eval", "control")


def tool_call(name: str, **arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@pytest.fixture(scope="module")
def control(slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlJob]:
    job = start_control(slurm, tmp_path_factory.mktemp("shared"), ROLLOUT_LEASE_TTL_S="8")
    yield job
    slurm.cancel(job.job_id)
    slurm.wait_state(job.job_id, {"CANCELLED", "COMPLETED", "FAILED"}, 60)


@pytest.fixture
def client(control: ControlJob) -> Iterator[RolloutClient]:
    with RolloutClient(control.gateway, token=control.token) as c:
        yield c


@pytest.fixture
def workers(slurm: SlurmCluster, control: ControlJob) -> Iterator[Callable[..., str]]:
    """``workers(*sbatch_args, **env) -> job id``: a workers.sbatch job with bwrap sandboxes,
    running once its pools consume; every job started is cancelled after the test."""
    started: list[str] = []

    def start(*args: str, **env: str) -> str:
        job_id = slurm.sbatch(
            SLURM_DIR / "workers.sbatch",
            "-N",
            "1",
            *(args or ("-c", "1")),
            **{**control.env, "ROLLOUT_SANDBOX": "bwrap", **env},
        )
        started.append(job_id)
        slurm.wait_state(job_id, {"RUNNING"}, 60)
        return job_id

    yield start
    for job_id in started:
        slurm.cancel(job_id, check=False)
    for job_id in started:
        slurm.wait_state(job_id, {"CANCELLED", "COMPLETED", "FAILED"}, 60)
        assert not job_processes(job_id), f"worker job {job_id} left processes behind"


def slow_math(
    client: RolloutClient, scripted_server: Callable[..., str], tokenizer: Path, turns: int, delay_s: float, n: int
) -> list[str]:
    problem = f"What is 2 + 2? ({uuid.uuid4().hex[:6]})"
    script = {
        "episodes": [
            {
                "match": problem,
                "turns": [
                    *[{"text": tool_call("ipython", code="print(2 + 2)"), "delay_s": delay_s}] * (turns - 1),
                    {"text": "\\boxed{4}\n" + tool_call("finish", answer="\\boxed{4}"), "delay_s": delay_s},
                ],
            }
        ]
    }
    model = f"scripted-{uuid.uuid4().hex[:6]}"
    client.add_backend(scripted_server(script), "vllm", model, tokenizer=str(tokenizer))
    return client.submit(
        {"domain": "math", "problem": problem, "answer": "4"},
        n=n,
        sampling={"model": model},
        agent={"tools": ["ipython", "finish"]},
    ).job_ids


def wait_running(client: RolloutClient, job_ids: list[str], count: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(client.get(j).status.value == "running" for j in job_ids) < count:
        assert time.monotonic() < deadline, [client.get(j).status.value for j in job_ids]
        time.sleep(0.2)


def assert_every_rollout_complete_and_whole(
    client: RolloutClient, job_ids: list[str], turns: int, timeout_s: float
) -> None:
    views = client.wait(job_ids, timeout_s=timeout_s)
    assert [v.status.value for v in views] == ["completed"] * len(job_ids), [v.error for v in views]
    for job_id in job_ids:
        trajectory = client.trajectory(job_id)
        assert trajectory.reward == 1.0
        assert sum(t.kind == "generation" for t in trajectory.turns) == turns


def test_the_control_jobs_redis_takes_only_its_generated_password(control: ControlJob):
    for name in ("redis.url", "broker.url", "state/redis/password", "state/broker/password"):
        mode = stat.S_IMODE((control.shared_dir / name).stat().st_mode)
        assert mode == 0o600, f"{name} is {oct(mode)}"
    config = (control.shared_dir / "state/redis/redis.conf").read_text()
    assert "requirepass " in config and "protected-mode no" not in config and "bind 127.0.0.1" in config
    password = (control.shared_dir / "state/redis/password").read_text().strip()
    assert len(password) >= 32 and f":{password}@" in control.redis_url
    anonymous = redis.Redis.from_url(control.redis_url.replace(f":{password}@", ""))
    with pytest.raises(redis.AuthenticationError):
        anonymous.get("anything")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(control.redis_url.replace(password, "guess")).ping()
    assert httpx.get(f"{control.gateway}/v1/backends").status_code == 401


def test_jobs_through_the_gateway_complete_on_a_worker_job_sized_from_slurm(
    control, client, workers, scripted_server, tiny_tokenizer_dir
):
    job_id = workers("-c", "2")
    job_ids = slow_math(client, scripted_server, tiny_tokenizer_dir, turns=2, delay_s=0.0, n=3)
    assert_every_rollout_complete_and_whole(client, job_ids, turns=2, timeout_s=120)

    pools = {}
    for command, environ in job_processes(job_id).values():
        if "celery" in " ".join(command) and "-Q" in command:
            pools[command[command.index("-Q") + 1]] = environ
    assert set(pools) == set(BROKER_QUEUES)
    assert pools["eval"]["SLURM_CPUS_PER_TASK"] == "2" and pools["eval"]["ROLLOUT_EVAL_CONCURRENCY"] == "2"
    assert pools["run"]["ROLLOUT_SANDBOX"] == "bwrap"
    state, broker = redis.Redis.from_url(control.redis_url), redis.Redis.from_url(control.broker_url)
    assert state.exists(f"rollout:job:{job_ids[0]}") and not broker.exists(f"rollout:job:{job_ids[0]}")
    assert broker.exists("_kombu.binding.run") and not state.exists("_kombu.binding.run")


def test_a_cancelled_worker_job_loses_nothing_once_another_starts(
    slurm, control, client, workers, scripted_server, tiny_tokenizer_dir
):
    first = workers()
    job_ids = slow_math(client, scripted_server, tiny_tokenizer_dir, turns=4, delay_s=1.0, n=4)
    wait_running(client, job_ids, 2)
    slurm.cancel(first)  # SIGTERM, SIGKILL 2 s later (KillWait): episodes die mid-turn
    slurm.wait_state(first, {"CANCELLED"}, 60)
    assert not job_processes(first)
    assert any(client.get(j).status.value not in ("completed", "queued") for j in job_ids)
    workers()
    assert_every_rollout_complete_and_whole(client, job_ids, turns=4, timeout_s=120)


def test_a_worker_job_told_to_stop_finishes_what_it_runs_and_hands_back_the_rest(
    slurm, control, client, workers, scripted_server, tiny_tokenizer_dir
):
    lease = {"ROLLOUT_LEASE_TTL_S": "600"}  # recovery would wait 10 minutes: only a hand-back can be seen
    first = workers(**lease, ROLLOUT_RUN_CONCURRENCY="2", ROLLOUT_STAGE_BATCH_MAX_JOBS="1")
    job_ids = slow_math(client, scripted_server, tiny_tokenizer_dir, turns=3, delay_s=1.0, n=6)
    wait_running(client, job_ids, 2)
    running = [j for j in job_ids if client.get(j).status.value == "running"]
    slurm.cancel(first, "--batch", "--signal=TERM")  # what --signal=B:TERM@120 sends before the time limit
    assert slurm.wait_state(first, {"COMPLETED", "FAILED"}, 90) == "COMPLETED", slurm.output(first)
    assert not job_processes(first)
    assert [client.get(j).status.value for j in running] == ["completed"] * len(running)
    broker = redis.Redis.from_url(control.broker_url)
    held = [raw.decode() for raw in broker.hvals("unacked")]  # the earlier test's killed worker left its own
    assert not [m for m in held if any(j in m for j in job_ids)], held
    waiting = [j for j in job_ids if client.get(j).status.value != "completed"]
    assert waiting and sum(broker.llen(k) for k in broker.scan_iter("run*") if broker.type(k) == b"list") > 0
    workers(**lease)
    assert_every_rollout_complete_and_whole(client, job_ids, turns=3, timeout_s=90)
