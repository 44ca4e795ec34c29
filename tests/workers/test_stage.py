"""workers/stage.py on a real Redis: how a stage begins and ends the jobs one message carries."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rollout_service.devtools.redis_server import RedisServer
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


class RestartingRedis:
    """A Redis of the test's own (AOF on, as `up` runs it) that a stage's body kills with SIGKILL;
    it comes back on the same port after ``down_s``."""

    def __init__(self, data_dir: Path) -> None:
        self.server = RedisServer(data_dir).start()

    def kill_for(self, down_s: float) -> threading.Thread:
        assert self.server.process is not None
        self.server.process.kill()
        self.server.process.wait()
        back = threading.Thread(target=lambda: (time.sleep(down_s), self.server.start()), daemon=True)
        back.start()
        return back

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture
def restarting_redis(tmp_path: Path) -> Iterator[RestartingRedis]:
    redis_ = RestartingRedis(tmp_path / "redis")
    yield redis_
    redis_.stop()


def running_job(store: JobStore, **timeouts: float) -> str:
    ((job_ids, _),) = store.create_many(
        [JobRequest(task={"domain": "math", "problem": "1+1", "answer": "2"}, timeouts=timeouts)]
    )
    assert store.transition(job_ids[0], JobStatus.initializing, init_end=time.time())
    return job_ids[0]


def test_a_stage_whose_redis_restarts_mid_body_waits_it_out_and_its_job_goes_on(restarting_redis, celery_app):
    celery_app(restarting_redis.server.url, ROLLOUT_LEASE_TTL_S="2")
    from workers.stage import job_store, run_stage_jobs

    store = job_store()
    job_id = running_job(store)
    back: list[threading.Thread] = []

    def body(ctx) -> None:
        back.append(restarting_redis.kill_for(1.5))
        store.set_fields(ctx.job_id, during="the outage")  # sent while Redis is down: retried until it is back
        ctx.results["trajectory"] = {"turns": []}

    going_on = run_stage_jobs([job_id], "run", body)
    back[0].join()
    fields = store.redis.hgetall(store.key(job_id))
    assert going_on == [job_id], fields
    assert (fields[b"status"], fields[b"during"], fields[b"attempts_run"]) == (b"running", b"the outage", b"1")
    assert b"run_end" in fields and store.redis.get(store.key(job_id, "lease")) is None


def test_a_stage_whose_redis_stays_away_longer_than_its_wait_hands_its_job_back_instead_of_failing_it(
    restarting_redis, celery_app
):
    celery_app(restarting_redis.server.url, ROLLOUT_REDIS_RETRIES="0", ROLLOUT_REDIS_OUTAGE_WAIT_S="0.5")
    from workers import dispatch
    from workers.stage import job_store, run_stage_jobs

    store = job_store()
    job_id = running_job(store)

    def body(ctx) -> None:
        restarting_redis.kill_for(2.0)
        store.set_fields(ctx.job_id, during="the outage")

    assert run_stage_jobs([job_id], "run", body) == []
    fields = store.redis.hgetall(store.key(job_id))
    assert (fields[b"status"], fields.get(b"recovery_run"), fields.get(b"error_code")) == (b"running", b"1", None)
    assert store.redis.get(store.key(job_id, "lease")) is None
    assert dispatch.messages_present(store.redis, [dispatch.stage_mark(job_id, "run")]) == {f"{job_id}.run"}
    ((verdict, values, _),) = store.begin_stages([job_id], "run", JobStatus.initializing, JobStatus.running, "next")
    assert (verdict, values[1]) == ("ok", "2"), "the next delivery takes the stage over"


def test_a_job_whose_deadline_passes_while_redis_is_away_ends_timed_out_naming_the_store(restarting_redis, celery_app):
    celery_app(restarting_redis.server.url, ROLLOUT_REDIS_RETRIES="0", ROLLOUT_REDIS_OUTAGE_WAIT_S="2")
    from workers.stage import job_store, run_stage_jobs

    store = job_store()
    job_id = running_job(store, job_s=3.0)

    def body(ctx) -> None:  # away longer than a command waits, back after the deadline
        restarting_redis.kill_for(max(ctx.remaining_s(), 2.0) + 0.5)
        store.set_fields(ctx.job_id, during="the outage")

    run_stage_jobs([job_id], "run", body)
    view = store.view(job_id)
    assert (view.status, view.finish_reason) == (JobStatus.timed_out, FinishReason.deadline)
    assert view.error is not None and "state store (Redis) was unreachable during run" in view.error.message
