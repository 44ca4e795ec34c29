"""workers/stage.py on a real Redis: how a stage begins and ends the jobs one message carries."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from rollout_service.runtime.trajectory import TrajectoryBuilder
from rollout_service.schemas import FinishReason, JobRequest, JobStatus
from rollout_service.state.store import JobStore


@pytest.fixture
def store(redis_client, redis_url, celery_app) -> JobStore:
    celery_app(redis_url)
    from workers.stage import job_store

    return job_store()


def graded_three_jobs(store: JobStore, run: Callable[[list[str], Callable], None]) -> dict:
    """Three running jobs of one message through ``run(job_ids, grade)``: what each grading saw of
    the message's jobs as it began, their final statuses and the finished-job metrics recorded."""
    ((job_ids, _),) = store.create_many([JobRequest(task={"domain": "math", "problem": "1+1", "answer": "2"}, n=3)])
    for job_id in job_ids:
        assert store.transition(job_id, JobStatus.running)
    seen = []

    def grade(ctx) -> None:
        seen.append([store.status(job_id).value for job_id in job_ids])
        ctx.finish_as = (JobStatus.completed, {"reward": 1.0})

    run(job_ids, grade)
    counted = sum(
        int(n)
        for field, n in store.redis.hgetall("rollout:metrics:counters").items()
        if field.startswith(b"rollout_jobs_finished|")
    )
    return {"seen": seen, "final": [store.status(job_id).value for job_id in job_ids], "counted": counted}


def test_eval_completes_each_job_of_a_message_before_it_grades_the_next(store, monkeypatch):
    from workers import eval as eval_stage

    def run(job_ids: list[str], grade: Callable) -> None:
        monkeypatch.setattr(eval_stage, "score_job", grade)
        eval_stage.eval_jobs.run(job_ids)

    result = graded_three_jobs(store, run)
    assert result["seen"] == [
        ["evaluating", "evaluating", "evaluating"],
        ["completed", "evaluating", "evaluating"],
        ["completed", "completed", "evaluating"],
    ]
    assert result["final"] == ["completed"] * 3 and result["counted"] == 3  # their metrics: one write at the end


def test_a_stage_that_ends_its_jobs_together_keeps_each_in_the_stage_until_the_last_is_done(store):
    from workers.stage import run_stage_jobs

    result = graded_three_jobs(store, lambda job_ids, grade: run_stage_jobs(job_ids, "eval", grade))
    assert result["seen"][2] == ["evaluating"] * 3 and result["final"] == ["completed"] * 3 and result["counted"] == 3


def test_a_job_cancelled_after_its_episode_ended_has_a_trajectory_that_says_cancelled(store):
    from workers.stage import run_stage_jobs

    ((job_ids, _),) = store.create_many([JobRequest(task={"domain": "math", "problem": "1+1", "answer": "2"})])
    (job_id,) = job_ids
    assert store.transition(job_id, JobStatus.running)
    episode = TrajectoryBuilder([1, 2, 3], [{"role": "user", "content": "1+1"}])
    episode.add_generation(
        [7, 8], [-0.5, -0.25], backend_id="be-x", policy_version=0, finish_reason="stop", latency_s=0.1
    )
    store.put_trajectory(job_id, episode.build(FinishReason.no_tool_call))
    store.cancel(job_id)  # after its episode ended, before it was graded
    run_stage_jobs([job_id], "eval", lambda ctx: None)
    trajectory = store.trajectory(job_id)
    assert store.status(job_id).value == "cancelled"
    assert trajectory.finish_reason.value == "cancelled" and trajectory.truncated
    assert trajectory.response_ids == [7, 8] and trajectory.logprobs == [-0.5, -0.25]
