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


@pytest.mark.parametrize(
    "task, hint",
    [
        (
            {"domain": "code", "prompt": "def add(a, b):\n", "test": "assert add(1, 2) == 3", "entry_point": "add"},
            " When you are done, call finish with the complete code (imports and `add`).",
        ),
        (
            {"domain": "stem", "question": "Which is a noble gas?", "choices": ["Neon", "Iron"], "answer": "A"},
            "\n\nCall finish with the letter of the correct choice.",
        ),
    ],
    ids=["code", "stem"],
)
def test_the_built_in_agent_is_told_to_call_finish_and_a_harness_which_has_no_such_tool_is_not(
    tmp_path, tiny_tokenizer_dir, task, hint
) -> None:
    from dataclasses import dataclass, field
    from typing import Any

    from rollout_service.runtime.harness import harness_messages, task_text
    from rollout_service.runtime.preparation import prepare_job
    from rollout_service.schemas import BackendView

    @dataclass
    class Stage:
        job_id: str
        store: Any = None
        settings: Settings = field(default_factory=lambda: Settings(state_dir=str(tmp_path)))
        end_fields: dict[str, Any] = field(default_factory=dict)

    backends = [
        BackendView(
            id="be-1",
            url="http://127.0.0.1:9",
            kind="vllm",
            model="m",
            tokenizer=str(tiny_tokenizer_dir),
            healthy=True,
            live_assignments=0,
            total_assignments=0,
            policy_version=0,
        )
    ]
    built_in = prepare_job(Stage("job-agent"), JobRequest(task=task), list(backends))
    harnessed = prepare_job(
        Stage("job-harness"),
        JobRequest(task=task, agent={"harness": {"command": ["python", "-c", "pass"]}}),
        list(backends),
    )
    (agent_user,) = [m["content"] for m in built_in.messages if m["role"] == "user"]
    assert agent_user.endswith(hint)
    assert task_text(harness_messages(harnessed.messages, False)) == agent_user.removesuffix(hint)
    assert "finish" not in str(harness_messages(harnessed.messages, False))
