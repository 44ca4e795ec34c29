"""The control worker: its housekeeping sends the stage of a job whose worker died again (and the
stage gives up past ROLLOUT_MAX_REDELIVERIES), and it decides a batch's groups as their members end."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable

import redis

from rollout_service.concurrency.broker import queue_keys
from rollout_service.schemas import BackendView, FinishReason, JobRequest, JobStatus
from rollout_service.sdk.client import RolloutClient
from rollout_service.settings import Settings
from rollout_service.state.keys import recovery_field
from rollout_service.state.store import JobStore
from tests.fixtures_service import Service
from tests.helpers import math_task, server_log, tool_call
from workers import control

DEAD_LEASE_S = 1  # the dead workers' leases lapse at once


def job_whose_run_worker_died(
    service: Service, problem: str, model: str, deliveries: int, job_s: float | None = None
) -> str:
    """A math job (enqueued nowhere) whose run stage was delivered ``deliveries`` times to workers that
    died mid-stage, the last long enough ago for housekeeping to count it lost."""
    settings = dataclasses.replace(Settings.from_env(service.env), lease_ttl_s=DEAD_LEASE_S)
    store = JobStore(service.redis(), settings, on_finished=[])
    (job_id,), _ = store.create_jobs(
        JobRequest.model_validate(
            {"task": math_task(problem), "sampling": {"model": model}, "timeouts": {"job_s": job_s}}
        )
    )
    for delivery in range(deliveries):
        if delivery:  # housekeeping found the last delivery lost and sent this one
            time.sleep(DEAD_LEASE_S + 0.1)
            store.set_fields(job_id, **{recovery_field("run"): delivery})
        ((verdict, _, _),) = store.begin_stages(
            [job_id],
            "run",
            JobStatus.initializing,
            JobStatus.running,
            f"dead-worker-{delivery}",
            skipping=(JobStatus.queued, "init_start"),
        )
        assert verdict == "ok", verdict
    store.set_fields(job_id, run_start=time.time() - 600)
    return job_id


def test_housekeeping_sends_the_run_of_a_job_whose_worker_died_again_and_the_job_completes_once(
    service: Service, client: RolloutClient, scripted_model: Callable[[dict], BackendView], model_name: str
) -> None:
    problem = f"Orphan ({uuid.uuid4().hex[:6]})"
    backend = scripted_model({"episodes": [{"match": problem, "turns": [tool_call("finish", answer="4")]}]})
    job_id = job_whose_run_worker_died(service, problem, model_name, deliveries=1)
    (view,) = client.wait([job_id], timeout_s=60)

    assert (view.status, view.reward, view.attempts) == (JobStatus.completed, 1.0, 2), view.error
    assert len(server_log(backend.url)) == 1
    assert f"job {job_id} lost its run worker" in service.log("worker-control")


def test_a_redelivered_stage_fails_a_job_past_max_redeliveries_and_times_out_one_past_its_deadline(
    service: Service, client: RolloutClient, model_name: str
) -> None:
    limit = Settings.from_env(service.env).max_redeliveries
    crashing = job_whose_run_worker_died(service, f"Crashing ({uuid.uuid4().hex[:6]})", model_name, deliveries=limit)
    late = job_whose_run_worker_died(service, f"Late ({uuid.uuid4().hex[:6]})", model_name, deliveries=1, job_s=0.5)
    crashed, expired = client.wait([crashing, late], timeout_s=60)

    assert crashed.status == JobStatus.failed and crashed.error is not None and crashed.attempts == limit + 1
    assert crashed.error.code == "redelivery_limit"
    assert f"delivered {limit + 1} times" in crashed.error.message
    assert "ROLLOUT_MAX_REDELIVERIES" in crashed.error.message
    assert expired.status == JobStatus.timed_out and expired.error is not None and expired.attempts == 2
    assert (expired.error.code, expired.finish_reason) == ("deadline", FinishReason.deadline)
    assert "deadline passed before run started" in expired.error.message


def test_the_control_worker_accepts_a_batchs_group_once_its_members_end_and_completes_the_batch(
    client: RolloutClient, scripted_model: Callable[[dict], BackendView], model_name: str
) -> None:
    problem = f"Batch ({uuid.uuid4().hex[:6]})"
    scripted_model({"episodes": [{"match": problem, "turns": [tool_call("finish", answer="4")]}]})
    run = client.batch(
        [math_task(problem)],
        group_size=2,
        target_groups=1,
        sampling={"model": model_name},
        progress=False,
        timeout_s=60,
    )
    (group,) = run.groups()
    view = run.view()

    assert [r.reward for r in group.rollouts] == [1.0, 1.0]
    assert (view.status.value, view.reason, view.accepted, view.in_flight) == ("completed", "target_reached", 1, 0)


def test_housekeeping_removes_the_workspaces_of_ended_and_unknown_jobs_and_keeps_the_live_ones(
    redis_client: redis.Redis, redis_url: str, tmp_path
) -> None:
    store = JobStore(redis_client, Settings(redis_url=redis_url, state_dir=str(tmp_path)), on_finished=[])
    live, ended = (store.create_jobs(JobRequest.model_validate({"task": math_task("1+1")}))[0][0] for _ in range(2))
    store.finish(ended, JobStatus.failed, RuntimeError("gone"))
    for job_id in (live, ended, "job-never-existed"):
        (store.settings.workspaces_path / job_id).mkdir(parents=True)

    assert sorted(control.remove_ended_workspaces(store)) == sorted([ended, "job-never-existed"])
    assert [p.name for p in store.settings.workspaces_path.iterdir()] == [live]


def test_housekeeping_reads_the_fields_of_live_jobs_without_a_lease_only(
    redis_client: redis.Redis, redis_url: str
) -> None:
    store = JobStore(redis_client, Settings(redis_url=redis_url), on_finished=[])
    running, waiting = (
        store.create_jobs(JobRequest.model_validate({"task": math_task("1+1")}))[0][0] for _ in range(2)
    )
    store.begin_stages([running], "init", JobStatus.queued, JobStatus.initializing, "a-live-worker")
    unleased = [job_id for job_id in store.live_jobs() if not redis_client.exists(store.key(job_id, "lease"))]
    before = redis_client.info("commandstats").get("cmdstat_hmget", {}).get("calls", 0)

    assert control.recover_orphans(store) == []  # neither waited two lease TTLs
    assert redis_client.info("commandstats")["cmdstat_hmget"]["calls"] - before == len(unleased)
    assert waiting in unleased and running not in unleased


def test_housekeeping_recovers_a_begun_stage_only_once_two_scans_a_lease_ttl_apart_found_it_unleased_and_again_if_that_is_lost(
    redis_client: redis.Redis, redis_url: str, celery_app
) -> None:
    celery_app(redis_url, ROLLOUT_LEASE_TTL_S=str(DEAD_LEASE_S))
    from workers import dispatch
    from workers.stage import job_store

    store = job_store()
    (job_id,), _ = store.create_jobs(JobRequest.model_validate({"task": math_task("1+1")}))
    store.begin_stages(
        [job_id],
        "run",
        JobStatus.initializing,
        JobStatus.running,
        "dead-worker",
        skipping=(JobStatus.queued, "init_start"),
    )
    store.set_fields(job_id, run_start=time.time() - 600)
    time.sleep(DEAD_LEASE_S + 0.1)  # its lease lapsed: a dead worker, or a live one about to take it again

    assert control.recover_orphans(store) == [], "one sighting is not enough"
    time.sleep(DEAD_LEASE_S + 0.1)
    assert control.recover_orphans(store) == [job_id]
    assert redis_client.hget(store.key(job_id), "recovery_run") == b"1", "the re-sent delivery may take it over"
    assert dispatch.messages_present(redis_client, [f"{job_id}.run"]) == {f"{job_id}.run"}
    assert control.recover_orphans(store) == [], "once per delivery while its message may still come"
    redis_client.delete(*queue_keys("run"))  # that message is lost
    redis_client.delete(store.key(job_id, "recovery:run:1"))  # ... and two lease TTLs passed
    assert control.recover_orphans(store) == [job_id]
