"""Flower tells the truth about stages: every stage task that carried a job is SUCCESS, whatever became of the job."""

from __future__ import annotations

import subprocess
import time
import uuid

import httpx

from rollout_service.devtools.redis_server import free_port
from rollout_service.launch.commands import flower_command
from rollout_service.settings import Settings
from tests.helpers import math_task, tool_call


def test_flower_shows_every_finished_stage_as_success_for_completed_and_failed_jobs(service, client, scripted_backend):
    problem = f"Flower ({uuid.uuid4().hex[:6]})"
    # an answer math-verify must read (not a plain number, which the run worker scores itself) goes to eval
    scripted_backend({"episodes": [{"match": problem, "turns": [tool_call("finish", answer="\\boxed{\\frac{8}{2}}")]}]})
    port = free_port()
    env = {**service.env, "ROLLOUT_FLOWER_PORT": str(port), "FLOWER_UNAUTHENTICATED_API": "1"}
    flower = subprocess.Popen(
        flower_command(Settings.from_env(env)), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    flower_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{flower_url}/healthcheck", timeout=2).is_success:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        time.sleep(2)  # Flower has subscribed to the event stream
        (completed,) = client.submit(math_task(problem)).job_ids
        (failed,) = client.submit(
            math_task(problem), sampling={"max_new_tokens": 1}, timeouts={"llm_call_s": 0.001}
        ).job_ids
        views = client.wait([completed, failed], timeout_s=120)
        assert [v.status.value for v in views] == ["completed", "failed"], [v.error for v in views]

        # math prepares cheaply: its jobs start at run (tasks.first_stage), so Flower lists no init task
        expected = {(completed, "run"), (completed, "eval"), (failed, "run")}
        deadline = time.monotonic() + 30
        while True:
            answer = httpx.get(f"{flower_url}/api/tasks", timeout=10)
            assert answer.is_success, (answer.status_code, answer.text[:500])
            states = {
                (job_id, task["name"].rsplit(".", 1)[0].rsplit(".", 1)[1]): task["state"]
                for task in answer.json().values()
                for job_id in (completed, failed)
                if job_id in (task.get("args") or "")
            }
            if set(states) == expected and set(states.values()) == {"SUCCESS"} or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert states == {stage: "SUCCESS" for stage in expected}  # a job that ended in run has no eval task
    finally:
        flower.terminate()
        flower.wait(15)
