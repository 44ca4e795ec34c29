"""workers/episodes.py: how a run worker shares itself among episodes (slots, the prefetch window,
start gaps, jobs given back to the queue, the first call sent with the stage's begin) against a real
Redis."""

from __future__ import annotations

import threading
import time

import pytest
from kombu.common import QoS

from rollout_service.errors import DeadlineExceeded
from rollout_service.schemas import BackendSpec, BackendView, JobRequest, JobStatus
from rollout_service.state.backends import BackendPool
from workers.episodes import EpisodeRunner, EpisodeStart, Slots


def test_a_full_worker_gives_the_jobs_it_has_no_slot_for_back_to_the_run_queue_and_starts_the_rest_apart(
    redis_client, redis_url, celery_app
) -> None:
    celery_app(redis_url, ROLLOUT_RUN_CONCURRENCY="2", ROLLOUT_EPISODE_START_GAP_MS="200")
    from workers import dispatch

    runner = EpisodeRunner(slot_wait_s=0.05)
    started: dict[str, float] = {}
    running, most_at_once, lock = [0], [0], threading.Lock()

    def episode(job_id: str, start: EpisodeStart) -> None:
        assert start.job_id == job_id and start.take_first_call() is None  # no stage began: no first call
        with lock:
            started[job_id] = time.monotonic()
            running[0] += 1
            most_at_once[0] = max(most_at_once[0], running[0])
        time.sleep(0.5)
        with lock:
            running[0] -= 1

    runner.run(["job-a", "job-b", "job-c"], episode)

    assert sorted(started) == ["job-a", "job-b"] and most_at_once[0] == 2
    assert started["job-b"] - started["job-a"] >= 0.15  # the 0.2 s gap, less the first thread's start
    assert runner.slots.used == 0
    assert dispatch.queue_lengths(redis_client)["run"] == {"queued": 1, "unacked": 0}
    assert dispatch.messages_present(redis_client, [dispatch.stage_mark("job-c", "run")]) == {"job-c.run"}


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the episode's own thread fails
def test_an_episode_that_fails_still_gives_its_slot_back(redis_client, redis_url, celery_app) -> None:
    celery_app(redis_url, ROLLOUT_RUN_CONCURRENCY="1")
    runner = EpisodeRunner()

    def episode(job_id: str, start: EpisodeStart) -> None:
        raise RuntimeError("boom")

    runner.run(["job-a"], episode)
    assert runner.slots.used == 0


def test_slots_shrink_the_prefetch_window_by_the_extra_jobs_of_a_message_until_they_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from workers import celery_app

    window = QoS(lambda prefetch_count: None, 10)
    monkeypatch.setattr(celery_app, "worker_slots", 4)
    monkeypatch.setattr(celery_app, "consumer_qos", window)
    slots = Slots()

    assert slots.take(3, wait_s=0) == 3 and window.value == 8  # one message, three jobs
    assert slots.take(5, wait_s=0) == 1 and window.value == 8  # only one slot was left
    began = time.monotonic()
    assert slots.take(1, wait_s=0.1) == 0 and time.monotonic() - began >= 0.1  # full: waited, then none
    slots.give_back(beyond_first=True)
    slots.give_back(beyond_first=True)
    assert window.value == 10 and slots.used == 2
    slots.give_back(beyond_first=False)  # the message's own job: its ack reopens the window
    assert window.value == 10 and slots.used == 1


def test_a_first_call_sent_with_the_stage_begin_that_the_episode_never_took_is_dropped_with_its_assignment(
    redis_client, redis_url, celery_app
) -> None:
    celery_app(redis_url, ROLLOUT_RUN_CONCURRENCY="1")
    from workers.stage import StageContext, job_store, run_stage_jobs

    store, pool = job_store(), BackendPool(redis_client)
    backend = pool.register(BackendSpec(url="http://127.0.0.1:9", kind="vllm", model="tiny-model"))
    request = JobRequest.model_validate({"task": {"domain": "math", "problem": "1+1", "answer": "2"}})
    (job_id,), _ = store.create_many([request])[0]
    redis_client.hset(store.key(job_id), "first_call_model", "tiny-model")
    granted: list[BackendView | None] = []

    def body(ctx: StageContext, start: EpisodeStart) -> None:
        granted.append(start.granted_backend())
        assert pool.backend_of(job_id) == backend.id and pool.inflight_calls() == 1
        raise DeadlineExceeded("the job ran out of time before its episode")

    def episode(job_id: str, start: EpisodeStart) -> None:
        run_stage_jobs([job_id], "run", lambda ctx: body(ctx, start), calls=start.begin_call())

    EpisodeRunner().run([job_id], episode)

    assert [view.id if view else None for view in granted] == [backend.id]
    assert pool.backend_of(job_id) is None and pool.inflight_calls() == 0
    assert store.fields(job_id)["status"] == JobStatus.timed_out.value
