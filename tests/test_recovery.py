"""Faults the service must survive: a worker killed mid-episode, Redis-held state intact."""
from __future__ import annotations

import os
import signal
import uuid

from rollout_service.cli import worker_command
from rollout_service.settings import Settings
from tests.fixtures_service import running_service
from tests.test_llm import slow_script, wait_for
from tests.test_pipeline import math_task, server_log


def test_a_run_worker_killed_mid_episode_is_replaced_and_its_job_completes_once(
        tmp_path, scripted_server, tiny_tokenizer_dir):
    problem = f"Crash ({uuid.uuid4().hex[:6]})"
    url = scripted_server(slow_script(problem, turns=6, delay_s=0.4))
    with running_service(tmp_path / "svc", ROLLOUT_LEASE_TTL_S="2",
                         ROLLOUT_BACKEND_PROBE_INTERVAL_S="1") as service, service.client() as client:
        client.add_backend(url, "vllm", "crashy", tokenizer=str(tiny_tokenizer_dir))
        job_id, = client.submit(math_task(problem)).job_ids
        redis = service.redis()
        wait_for(lambda: len(server_log(url)) >= 2, what="the episode to be under way")
        run_worker = next(c for c in service.supervisor.children if c.name == "worker-run")
        os.killpg(run_worker.process.pid, signal.SIGKILL)
        run_worker.process.wait()
        service.supervisor.children.remove(run_worker)
        service.supervisor.start("worker-run-2", worker_command(Settings.from_env(service.env), "run"))

        view, = client.wait([job_id], timeout_s=90)
        assert view.status.value == "completed" and view.reward == 1.0
        assert int(redis.hget(f"rollout:job:{job_id}", "attempts_run")) == 2
        assert [b.live_assignments for b in client.backends()] == [0]
        trajectory = client.trajectory(job_id)
        assert sum(t.kind == "generation" for t in trajectory.turns) == 6


def test_a_redelivered_run_starts_from_the_workspace_init_prepared(tmp_path):
    from rollout_service.tasks import get_handler, restore_workspace

    workspace = tmp_path / "ws"
    handler = get_handler("code")
    task = {"domain": "code", "prompt": "def f():\n    ", "test": "def check(c):\n    assert c() == 1\n",
            "entry_point": "f"}
    workspace.mkdir()
    handler.prepare(task, workspace)
    pristine = {p.name: p.read_bytes() for p in workspace.iterdir()}
    (workspace / "solution.py").write_text("def f():\n    return 2\n")
    (workspace / "scratch.txt").write_text("left by the crashed attempt")
    restore_workspace(handler, task, workspace)
    assert {p.name: p.read_bytes() for p in workspace.iterdir()} == pristine


def test_a_redis_restart_loses_no_queued_job_and_the_gateway_answers_503_meanwhile(
        tmp_path, scripted_server, tiny_tokenizer_dir):
    import httpx

    from rollout_service.redis_server import RedisServer

    problem = f"Redis restart ({uuid.uuid4().hex[:6]})"
    url = scripted_server({"episodes": [{"match": problem, "turns": ["\\boxed{4}"]}]})
    with running_service(tmp_path / "svc") as service, service.client() as client:
        client.add_backend(url, "vllm", "steady", tokenizer=str(tiny_tokenizer_dir))
        for queue in ("init", "run", "eval"):  # nobody consumes: the jobs wait in Redis
            worker = next(c for c in service.supervisor.children if c.name == f"worker-{queue}")
            os.killpg(worker.process.pid, signal.SIGTERM)
            worker.process.wait()
            service.supervisor.children.remove(worker)
        queued = client.submit(math_task(problem), n=3).job_ids

        port = service.redis_server.port
        service.redis_server.stop()
        down = httpx.post(f"{service.url}/v1/jobs", json={"task": math_task(problem)})
        assert down.status_code == 503 and "Redis" in down.json()["error"]["message"]
        assert httpx.get(f"{service.url}/readyz").status_code == 503

        service.redis_server = RedisServer(service.redis_server.data_dir, port=port).start()
        settings = Settings.from_env(service.env)
        for queue in ("init", "run", "eval"):
            service.supervisor.start(f"worker-{queue}-again", worker_command(settings, queue))
        wait_for(lambda: httpx.get(f"{service.url}/readyz").status_code == 200, what="readiness")
        after = client.submit(math_task(problem)).job_ids
        views = client.wait(queued + after, timeout_s=90)
        assert [v.status.value for v in views] == ["completed"] * 4
