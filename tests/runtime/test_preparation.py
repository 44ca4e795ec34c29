"""rollout_service/runtime/preparation.py: one set of submission checks for the gateway and the first stage,
and the package boundaries it makes possible (nothing in rollout_service depends on workers; no
stage module imports another)."""

from __future__ import annotations

import httpx
import pytest

from rollout_service.schemas import JobRequest
from rollout_service.settings import Settings
from rollout_service.state.store import JobStore
from rollout_service.tasks import first_stage
from tests.helpers import wait_for
from workers import dispatch


@pytest.mark.parametrize(
    "task",
    [
        {"domain": "math", "problem": "1+1"},  # prepares cheaply: starts in run
        {"domain": "swe", "instance_id": "x", "base_commit": "abc1234"},  # starts in init
    ],
    ids=["math-run", "swe-init"],
)
def test_a_task_past_the_gateway_fails_in_its_first_stage_with_the_gateways_message(
    service, scripted_backend, celery_app, task
) -> None:
    scripted_backend({"episodes": []})  # without one, run's first call fails first (no_backend)
    answer = httpx.post(f"{service.url}/v1/jobs", json={"task": task}, timeout=30)
    assert answer.status_code == 400
    message = answer.json()["error"]["message"]
    assert message.startswith("task.") and "required" in message, message

    settings = Settings.from_env(service.env)
    request = JobRequest(task=task)
    jobs = JobStore(service.redis(), settings)
    job_ids, _ = jobs.create_jobs(request)  # written as the gateway would, without its checks
    stage = first_stage(request, settings)
    assert stage == ("run" if task["domain"] == "math" else "init")
    celery_app(service.redis_url)
    dispatch.enqueue_jobs(job_ids, stage)
    wait_for(
        lambda: jobs.view(job_ids[0]).status.value not in ("queued", "initializing", "running"),
        timeout_s=60,
        what=f"the job to end in {stage}",
    )
    view = jobs.view(job_ids[0])
    assert view.status.value == "failed"
    assert view.error is not None and (view.error.code, view.error.message) == ("invalid_request", message)
