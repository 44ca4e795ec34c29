"""The init stage through its real Celery worker: a job of a domain that prepares expensively (swe)
gets its repository checked out, its prompt rendered and its model's backend picked, or fails with a
typed reason before any LLM call."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

from rollout_service.runtime.tokens import renderer_for
from rollout_service.schemas import BackendView, JobView
from rollout_service.sdk.client import RolloutClient
from rollout_service.tools.schemas import tool_schemas
from tests.helpers import server_log, tool_call


def test_init_checks_out_the_repository_renders_the_prompt_and_picks_the_jobs_model(
    client: RolloutClient,
    scripted_model: Callable[[dict], BackendView],
    model_name: str,
    swe_task: dict,
    tiny_tokenizer_dir: Path,
) -> None:
    backend = scripted_model(
        {
            "episodes": [
                {
                    "match": swe_task["problem_statement"][-8:],
                    "turns": [
                        tool_call("bash", command="git rev-parse HEAD; git status --porcelain | wc -l"),
                        tool_call("finish", answer="nothing changed"),
                    ],
                }
            ]
        }
    )
    (job_id,) = client.submit(swe_task, sampling={"model": model_name}).job_ids
    (view,) = client.wait([job_id], timeout_s=120)

    assert view.status.value == "completed", view.error
    assert view.timings.init_s is not None and "init" in view.timings.waits_s
    assert view.backend_id == backend.id
    trajectory = client.trajectory(job_id)
    system, user = trajectory.messages[:2]
    assert (system["role"], user["role"]) == ("system", "user")
    assert f"(commit {swe_task['base_commit'][:12]})" in user["content"]
    expected = renderer_for(str(tiny_tokenizer_dir)).initial_prompt(
        [system, user], tool_schemas(["bash", "editor", "finish"])
    )
    assert trajectory.prompt_ids == expected == server_log(backend.url)[0]["prompt_ids"]
    checkout = next(m["content"] for m in trajectory.messages if m["role"] == "tool")
    assert checkout.split() == [swe_task["base_commit"], "0"]  # at the base commit, nothing changed


def submit_with_missing_commit(
    client: RolloutClient, scripted_model: Callable[[dict], BackendView], model_name: str, swe_task: dict
) -> tuple[JobView, str, str]:
    backend = scripted_model(
        {"episodes": [{"match": swe_task["problem_statement"][-8:], "turns": [tool_call("finish", answer="x")]}]}
    )
    missing = uuid.uuid4().hex[:12]
    (job_id,) = client.submit({**swe_task, "base_commit": missing}, sampling={"model": model_name}).job_ids
    (view,) = client.wait([job_id], timeout_s=60)
    return view, missing, backend.url


def test_init_fails_a_job_whose_base_commit_is_not_in_its_repository_with_a_task_error(
    client: RolloutClient, scripted_model: Callable[[dict], BackendView], model_name: str, swe_task: dict
) -> None:
    view, _, backend_url = submit_with_missing_commit(client, scripted_model, model_name, swe_task)
    assert view.status.value == "failed" and view.error is not None and view.error.code == "task_error"
    assert view.timings.init_s is not None and view.timings.run_s is None and view.reward is None
    assert server_log(backend_url) == []  # the episode never started


def test_init_names_the_missing_base_commit_in_its_error(
    client: RolloutClient, scripted_model: Callable[[dict], BackendView], model_name: str, swe_task: dict
) -> None:
    view, missing, _ = submit_with_missing_commit(client, scripted_model, model_name, swe_task)
    assert view.error is not None and f"task.base_commit {missing} is not a commit" in view.error.message
