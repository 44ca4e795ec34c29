"""Faults the service must survive: a worker killed mid-episode, Redis-held state intact."""

from __future__ import annotations

import os
import signal
import time
import uuid

from rollout_service.launch.commands import worker_command
from rollout_service.settings import Settings
from tests.fixtures_service import Service, running_service
from tests.helpers import math_task, server_log, slow_script, wait_for


def stop_worker(service: Service, queue: str, sig: int = signal.SIGTERM) -> None:
    worker = next(c for c in service.supervisor.children if c.name.startswith(f"worker-{queue}"))
    os.killpg(worker.process.pid, sig)
    worker.process.wait()
    service.supervisor.children.remove(worker)


def start_worker(service: Service, queue: str) -> None:
    service.supervisor.start(
        f"worker-{queue}-{uuid.uuid4().hex[:4]}", worker_command(Settings.from_env(service.env), queue)
    )


def test_a_run_worker_killed_mid_episode_is_replaced_and_its_job_completes_once(
    tmp_path, scripted_server, tiny_tokenizer_dir
):
    problem = f"Crash ({uuid.uuid4().hex[:6]})"
    url = scripted_server(slow_script(problem, turns=6, delay_s=0.4))
    with (
        running_service(tmp_path / "svc", ROLLOUT_LEASE_TTL_S="2", ROLLOUT_BACKEND_PROBE_INTERVAL_S="1") as service,
        service.client() as client,
    ):
        client.add_backend(url, "vllm", "crashy", tokenizer=str(tiny_tokenizer_dir))
        (job_id,) = client.submit(math_task(problem)).job_ids
        redis = service.redis()
        wait_for(lambda: len(server_log(url)) >= 2, what="the episode to be under way")
        stop_worker(service, "run", signal.SIGKILL)
        start_worker(service, "run")

        (view,) = client.wait([job_id], timeout_s=90)
        assert view.status.value == "completed" and view.reward == 1.0
        assert int(redis.hget(f"rollout:job:{job_id}", "attempts_run")) == 2
        assert [b.live_assignments for b in client.backends()] == [0]
        trajectory = client.trajectory(job_id)
        assert sum(t.kind == "generation" for t in trajectory.turns) == 6


def test_a_redelivered_run_starts_from_the_workspace_init_prepared(tmp_path):
    from rollout_service.tasks import get_handler, restore_workspace

    workspace = tmp_path / "ws"
    handler = get_handler("code")
    task = {
        "domain": "code",
        "prompt": "def f():\n    ",
        "test": "def check(c):\n    assert c() == 1\n",
        "entry_point": "f",
    }
    workspace.mkdir()
    handler.prepare(task, workspace)
    pristine = {p.name: p.read_bytes() for p in workspace.iterdir()}
    (workspace / "solution.py").write_text("def f():\n    return 2\n")
    (workspace / "scratch.txt").write_text("left by the crashed attempt")
    restore_workspace(handler, task, workspace)
    assert {p.name: p.read_bytes() for p in workspace.iterdir()} == pristine


def test_a_redis_restart_loses_no_queued_job_and_the_gateway_answers_503_meanwhile(
    tmp_path, scripted_server, tiny_tokenizer_dir
):
    import httpx

    from rollout_service.devtools.redis_server import RedisServer

    problem = f"Redis restart ({uuid.uuid4().hex[:6]})"
    url = scripted_server({"episodes": [{"match": problem, "turns": ["\\boxed{4}"]}]})
    with running_service(tmp_path / "svc") as service, service.client() as client:
        client.add_backend(url, "vllm", "steady", tokenizer=str(tiny_tokenizer_dir))
        for queue in ("init", "run", "eval"):  # nobody consumes: the jobs wait in Redis
            stop_worker(service, queue)
        queued = client.submit(math_task(problem), n=3).job_ids

        port = service.redis_server.port
        service.redis_server.stop()
        down = httpx.post(f"{service.url}/v1/jobs", json={"task": math_task(problem)})
        assert down.status_code == 503 and "Redis" in down.json()["error"]["message"]
        assert httpx.get(f"{service.url}/readyz").status_code == 503

        service.redis_server = RedisServer(service.redis_server.data_dir, port=port).start()
        for queue in ("init", "run", "eval"):
            start_worker(service, queue)
        wait_for(lambda: httpx.get(f"{service.url}/readyz").status_code == 200, what="readiness")
        after = client.submit(math_task(problem)).job_ids
        views = client.wait(queued + after, timeout_s=90)
        assert [v.status.value for v in views] == ["completed"] * 4


def test_stage_messages_the_broker_lost_are_sent_again_and_waiting_ones_are_not_duplicated(
    tmp_path, scripted_server, tiny_tokenizer_dir
):
    problem = f"Lost message ({uuid.uuid4().hex[:6]})"
    url = scripted_server({"episodes": [{"match": problem, "turns": ["\\boxed{4}"]}]})
    with (
        running_service(
            tmp_path / "svc",
            ROLLOUT_LEASE_TTL_S="2",
            ROLLOUT_INIT_IN_RUN="0",  # math goes through init
            ROLLOUT_BACKEND_PROBE_INTERVAL_S="1",
        ) as service,
        service.client() as client,
    ):
        client.add_backend(url, "vllm", "steady", tokenizer=str(tiny_tokenizer_dir))
        redis = service.redis()
        stop_worker(service, "run")
        (between_stages,) = client.submit(math_task(problem)).job_ids
        wait_for(lambda: redis.llen("run") == 1, what="init to hand the job to the run queue")
        stop_worker(service, "init")
        (queued,) = client.submit(math_task(problem)).job_ids
        assert redis.delete("init", "run") == 2  # popped and never recorded as unacked, as kombu loses them
        (waiting,) = client.submit(math_task(problem)).job_ids  # its message is in the queue: leave it alone
        wait_for(
            lambda: redis.llen("init") >= 2 and redis.llen("run") >= 1,
            timeout_s=60,
            what="housekeeping to send the lost messages again",
        )
        time.sleep(2 * 2 + 2 * 2 + 1)  # `waiting` has been a candidate long enough for another scan
        assert redis.llen("init") == 2 and redis.llen("run") == 1, "only the lost messages are sent again"
        start_worker(service, "init")
        start_worker(service, "run")

        views = client.wait([between_stages, queued, waiting], timeout_s=90)
        assert [v.status.value for v in views] == ["completed"] * 3
        assert [redis.hget(f"rollout:job:{j}", "attempts_init") for j in (between_stages, queued, waiting)] == [
            b"1"
        ] * 3
        log = service.log("worker-control")
        assert f"job {between_stages} lost its run message" in log and f"job {queued} lost its init message" in log
        assert waiting not in log


def test_a_job_that_skips_init_and_loses_its_run_message_is_sent_to_run_again(
    tmp_path, scripted_server, tiny_tokenizer_dir
):
    problem = f"Lost first message ({uuid.uuid4().hex[:6]})"
    url = scripted_server({"episodes": [{"match": problem, "turns": ["\\boxed{4}"]}]})
    with (
        running_service(tmp_path / "svc", ROLLOUT_LEASE_TTL_S="2", ROLLOUT_BACKEND_PROBE_INTERVAL_S="1") as service,
        service.client() as client,
    ):
        client.add_backend(url, "vllm", "steady", tokenizer=str(tiny_tokenizer_dir))
        redis = service.redis()
        stop_worker(service, "run")
        (lost,) = client.submit(math_task(problem)).job_ids
        assert redis.llen("init") == 0 and redis.delete("run") == 1  # math starts at run; its message is lost
        wait_for(lambda: redis.llen("run") >= 1, timeout_s=60, what="housekeeping to send the lost message again")
        assert redis.llen("init") == 0, "a job that skips init is re-sent to run, where it was enqueued"
        start_worker(service, "run")

        (view,) = client.wait([lost], timeout_s=90)
        assert view.status.value == "completed"
        fields = redis.hgetall(f"rollout:job:{lost}")
        assert b"attempts_init" not in fields and fields[b"attempts_run"] == b"1"
        assert f"job {lost} lost its run message" in service.log("worker-control")


def test_a_recovery_whose_message_never_reached_the_broker_is_made_again_on_a_later_pass(
    redis_client, redis_url, celery_app, monkeypatch
):
    celery_app(redis_url, ROLLOUT_LEASE_TTL_S="1")
    import redis

    from rollout_service.schemas import JobRequest
    from workers import control, dispatch
    from workers.stage import job_store

    store = job_store()
    (job_id,), _ = store.create_jobs(JobRequest(task={"domain": "math", "problem": "1+1", "answer": "2"}))
    store.redis.hset(
        store.key(job_id), mapping={"status": "running", "run_start": time.time() - 60, "attempts_run": 1}
    )  # its run worker died, its lease lapsed

    def broker_died(job_id: str, stage: str) -> None:
        raise redis.ConnectionError("Redis died between the claim and the message")

    sent: list[list[str]] = []
    monkeypatch.setattr(dispatch, "enqueue_from", broker_died)
    try:
        control.recover_orphans(store)
    except redis.ConnectionError:
        pass
    monkeypatch.setattr(dispatch, "enqueue_from", lambda job_id, stage: sent.append([job_id, stage]))
    assert control.recover_orphans(store) == []  # the same pass: claimed
    time.sleep(2 * store.settings.lease_ttl_s + 1.2)
    assert control.recover_orphans(store) == [job_id]  # a later pass: no message carries it, made again
    assert control.recover_orphans(store) == []
    assert sent == [[job_id, "run"]]
