"""The run stage through its real Celery worker: a job that skipped init is prepared, its episode
runs against the scripted backend in a bwrap sandbox and ends as a token-exact trajectory; a cancel
mid-episode ends it cancelled with the turns it made."""

from __future__ import annotations

import uuid
from collections.abc import Callable

from rollout_service.schemas import BackendView, FinishReason, JobStatus
from rollout_service.sdk.client import RolloutClient
from tests.helpers import (
    assert_trajectory_is_exactly_what_the_server_returned,
    math_task,
    server_log,
    slow_script,
    tool_call,
    wait_for,
)


def test_run_prepares_a_job_that_skipped_init_and_drives_its_episode_to_an_exact_trajectory(
    client: RolloutClient, scripted_model: Callable[[dict], BackendView], model_name: str
) -> None:
    problem = f"What is 6 * 7? ({uuid.uuid4().hex[:6]})"
    backend = scripted_model(
        {
            "episodes": [
                {
                    "match": problem,
                    "turns": [
                        "Let me compute.\n" + tool_call("bash", command="echo $((6 * 7))"),
                        "It is \\boxed{42}.\n" + tool_call("finish", answer="\\boxed{42}"),
                    ],
                }
            ]
        }
    )
    (job_id,) = client.submit(
        math_task(problem, answer="42"), sampling={"model": model_name}, agent={"tools": ["bash", "finish"]}
    ).job_ids
    (view,) = client.wait([job_id], timeout_s=60)

    assert view.status == JobStatus.completed and view.finish_reason is not None, view.error
    assert (view.finish_reason.value, view.reward, view.backend_id, view.attempts) == ("finished", 1.0, backend.id, 1)
    assert view.timings.init_s is not None  # math skips the init queue: the run worker prepares it
    assert view.timings.run_s is not None and view.timings.sandbox_boot_s is not None
    trajectory = client.trajectory(job_id)
    assert [t.kind for t in trajectory.turns] == ["generation", "observation", "generation"]
    assert next(m["content"] for m in trajectory.messages if m["role"] == "tool").strip() == "42"
    assert_trajectory_is_exactly_what_the_server_returned(trajectory, server_log(backend.url))
    assert next(b for b in client.backends() if b.id == backend.id).live_assignments == 0


def test_a_cancel_mid_episode_ends_the_run_cancelled_with_the_turns_it_made(
    client: RolloutClient, scripted_model: Callable[[dict], BackendView], model_name: str
) -> None:
    problem = f"Slow ({uuid.uuid4().hex[:6]})"
    backend = scripted_model(slow_script(problem, turns=20, delay_s=0.3))
    (job_id,) = client.submit(math_task(problem), sampling={"model": model_name}, agent={"max_turns": 20}).job_ids
    wait_for(lambda: len(server_log(backend.url)) >= 2, timeout_s=30, what="the episode to be under way")
    client.cancel(job_id)
    (view,) = client.wait([job_id], timeout_s=30)

    assert view.status == JobStatus.cancelled and view.finish_reason is not None
    assert view.finish_reason.value == "cancelled"
    trajectory = client.trajectory(job_id)
    generations = [t for t in trajectory.turns if t.kind == "generation"]
    assert trajectory.truncated and trajectory.finish_reason == FinishReason.cancelled and 1 <= len(generations) < 20
    answered = server_log(backend.url)[: len(generations)]  # a call the cancel cut short has no turn
    assert_trajectory_is_exactly_what_the_server_returned(trajectory, answered)
