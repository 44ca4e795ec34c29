"""JobStore as a state machine on a real Redis, through the methods the gateway and the stages call:
create, begin_stages / end_stages, finish, cancel, transition, view."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import redis
from celery import Celery

from rollout_service.errors import (
    DeadlineExceeded,
    NotFound,
    RolloutError,
    SandboxError,
    ScoringTimeout,
    TaskError,
)
from rollout_service.runtime.trajectory import TrajectoryBuilder
from rollout_service.schemas import (
    TERMINAL_STATUSES,
    BackendSpec,
    FinishReason,
    JobRequest,
    JobStatus,
)
from rollout_service.settings import Settings
from rollout_service.state.backends import BackendPool
from rollout_service.state.store import JobStore, StageEnd

# stage -> (status it begins from, its own status), as workers/stage.py runs them
STAGES = {
    "init": (JobStatus.queued, JobStatus.initializing),
    "run": (JobStatus.initializing, JobStatus.running),
    "eval": (JobStatus.running, JobStatus.evaluating),
}
LEASE_TTL_S = 1
OWNER = "worker-a"


@dataclass
class Jobs:
    store: JobStore
    announced: list[str] = field(default_factory=list)

    def create(self, **request: object) -> str:
        (job_id,), _ = self.store.create_jobs(
            JobRequest.model_validate({"task": {"domain": "math", "problem": "1+1", "answer": "2"}, **request})
        )
        return job_id

    def begin(self, job_id: str, stage: str, owner: str = OWNER) -> tuple[str, list[str]]:
        previous, status = STAGES[stage]
        ((verdict, values, _),) = self.store.begin_stages([job_id], stage, previous, status, owner)
        return verdict, values

    def end(
        self, job_id: str, stage: str, finish: tuple[JobStatus, dict] | None = None, owner: str = OWNER
    ) -> JobStatus | None:
        (status,) = self.store.end_stages([StageEnd(job_id, owner, {f"{stage}_end": time.time()}, finish=finish)])
        return status

    def walk_to(self, job_id: str, last: str | None) -> None:
        """Through every stage before ``last``, then into ``last`` (None: leave it queued)."""
        if last is None:
            return
        for stage in STAGES:
            if stage == last:
                assert self.begin(job_id, stage)[0] == "ok"
                return
            assert self.begin(job_id, stage)[0] == "ok" and self.end(job_id, stage) is not None
        raise ValueError(f"no stage {last!r}; stages: {list(STAGES)}")

    def status(self, job_id: str) -> JobStatus:
        return self.store.status(job_id)


@pytest.fixture
def jobs(redis_client: redis.Redis, redis_url: str) -> Jobs:
    announced: list[str] = []
    settings = Settings(redis_url=redis_url, lease_ttl_s=LEASE_TTL_S, max_redeliveries=3)
    return Jobs(
        JobStore(redis_client, settings, on_finished=[lambda job_id, _batch: announced.append(job_id)]), announced
    )


def partial_trajectory() -> TrajectoryBuilder:
    episode = TrajectoryBuilder([1, 2, 3], [{"role": "user", "content": "1+1"}])
    episode.add_generation(
        [7, 8, 9], [-0.5, -0.25, -1e-9], backend_id="be-x", policy_version=0, finish_reason="stop", latency_s=0.1
    )
    episode.add_observation([4, 5], 0.01)
    return episode


def test_a_job_goes_queued_initializing_running_evaluating_completed_and_announces_its_end_once(jobs: Jobs):
    job_id = jobs.create()
    seen: list[JobStatus | None] = [jobs.status(job_id)]
    for stage in STAGES:
        verdict, (deadline_at, attempts, rollout_index) = jobs.begin(job_id, stage)
        assert (verdict, attempts, rollout_index) == ("ok", "1", "0") and float(deadline_at) > time.time()
        seen.append(jobs.status(job_id))
        finish = (JobStatus.completed, {"reward": 1.0, "finish_reason": "finished"}) if stage == "eval" else None
        seen.append(jobs.end(job_id, stage, finish))
    assert seen == [
        JobStatus.queued,
        JobStatus.initializing,
        JobStatus.initializing,
        JobStatus.running,
        JobStatus.running,
        JobStatus.evaluating,
        JobStatus.completed,
    ]
    view = jobs.store.view(job_id)
    assert (view.status, view.reward, view.finish_reason, view.error, view.attempts) == (
        JobStatus.completed,
        1.0,
        FinishReason.finished,
        None,
        1,
    )
    assert all(
        span is not None and span >= 0
        for span in (view.timings.init_s, view.timings.run_s, view.timings.eval_s, view.timings.queued_s)
    )
    assert jobs.announced == [job_id] and job_id not in jobs.store.live_jobs()


def test_a_job_that_skips_init_begins_run_from_queued_and_gets_an_init_start(jobs: Jobs):
    job_id = jobs.create()
    ((verdict, _, _),) = jobs.store.begin_stages(
        [job_id], "run", JobStatus.initializing, JobStatus.running, OWNER, skipping=(JobStatus.queued, "init_start")
    )
    assert verdict == "ok" and jobs.status(job_id) == JobStatus.running
    assert "init_start" in jobs.store.fields(job_id)


@pytest.mark.parametrize("finish", [None, (JobStatus.completed, {"finish_reason": "finished"})], ids=["on", "ended"])
def test_a_run_stage_ends_with_its_backend_released_in_the_same_script_and_only_its_own_fields_set(
    jobs: Jobs, finish: tuple[JobStatus, dict] | None
):
    pool = BackendPool(jobs.store.redis, prefix="rollout")
    pool.register(BackendSpec(url="http://127.0.0.1:9", kind="vllm", model="m"))
    job_id = jobs.create()
    jobs.walk_to(job_id, "run")
    held = pool.acquire(job_id, "m")
    fields_before = set(jobs.store.fields(job_id))
    end = StageEnd(job_id, OWNER, {"run_end": time.time()}, finish=finish, call=pool.release_with_end(job_id))
    (status,) = jobs.store.end_stages([end])
    assert status == (JobStatus.completed if finish else JobStatus.running)
    assert pool.backend_of(job_id) is None and pool.get(held.id).live_assignments == 0
    added = set(jobs.store.fields(job_id)) - fields_before
    assert added == ({"run_end", "finish_reason", "finished_at"} if finish else {"run_end"})
    assert not jobs.store.redis.exists(jobs.store.key(job_id, "lease"))


@pytest.mark.parametrize("stage", [None, *STAGES], ids=["queued", *STAGES])
def test_a_cancel_at_each_stage_ends_the_job_cancelled_exactly_once(jobs: Jobs, stage: str | None):
    job_id = jobs.create()
    jobs.walk_to(job_id, stage)
    ended_here = jobs.store.cancel(job_id)
    if stage is None:  # nothing runs it yet: the cancel ends it at once
        assert ended_here and jobs.status(job_id) == JobStatus.cancelled
    else:  # a stage runs it: the flag goes up, the stage (or any redelivery of it) ends it
        assert not ended_here and jobs.status(job_id) == STAGES[stage][1] and jobs.store.cancel_requested(job_id)
        assert jobs.begin(job_id, stage, owner="worker-b") == ("cancelled", [])
        assert jobs.end(job_id, stage, (JobStatus.cancelled, {"finish_reason": "cancelled"})) == JobStatus.cancelled
    view = jobs.store.view(job_id)
    assert (view.status, view.finish_reason) == (JobStatus.cancelled, FinishReason.cancelled)
    assert jobs.announced == [job_id] and not jobs.store.cancel(job_id)


@pytest.mark.parametrize(
    "stage, error",
    [
        ("init", TaskError("task.repo does not exist: check its URL")),
        ("run", SandboxError("the sandbox's action server died")),
        ("eval", ScoringTimeout("scoring took longer than its limit")),
    ],
    ids=list(STAGES),
)
def test_a_failure_in_each_stage_ends_the_job_failed_with_its_typed_reason_and_keeps_the_partial_trajectory(
    jobs: Jobs, stage: str, error: RolloutError
):
    job_id = jobs.create()
    jobs.walk_to(job_id, stage)
    episode = partial_trajectory().build(FinishReason.error)
    jobs.store.put_trajectory(job_id, episode)
    assert jobs.store.finish(job_id, JobStatus.failed, error)
    view = jobs.store.view(job_id)
    assert view.status == JobStatus.failed and view.error is not None
    assert (view.error.code, view.error.message) == (error.code, str(error))
    kept = jobs.store.trajectory(job_id)
    assert (kept.response_ids, kept.logprobs, kept.loss_mask) == (
        [7, 8, 9, 4, 5],
        [-0.5, -0.25, -1e-9, 0.0, 0.0],
        [1, 1, 1, 0, 0],
    )
    assert kept.finish_reason == FinishReason.error and kept.truncated
    assert jobs.announced == [job_id]


def test_a_job_past_its_deadline_ends_timed_out_with_the_deadline_reason(jobs: Jobs):
    job_id = jobs.create(timeouts={"job_s": 1.0})
    created = time.time()
    verdict, (deadline_at, _, _) = jobs.begin(job_id, "init")
    assert verdict == "ok" and created - 1 < float(deadline_at) < created + 1.5
    assert jobs.store.finish(
        job_id,
        JobStatus.timed_out,
        DeadlineExceeded("job deadline passed before run started"),
        finish_reason=FinishReason.deadline.value,
    )
    view = jobs.store.view(job_id)
    assert (view.status, view.finish_reason, view.error and view.error.code) == (
        JobStatus.timed_out,
        FinishReason.deadline,
        "deadline",
    )


def test_a_begun_stage_whose_lease_lapsed_is_taken_over_only_by_the_delivery_recovery_marks_and_counts_every_delivery(
    jobs: Jobs,
):
    job_id = jobs.create()
    jobs.walk_to(job_id, "run")  # worker-a took the run lease and died
    assert jobs.begin(job_id, "run", owner="worker-b") == ("leased", [])  # a duplicate while the lease lives
    time.sleep(LEASE_TTL_S + 0.1)  # nobody renews the dead worker's lease
    # lapsed, but nobody found the delivery lost: its holder may be alive and about to take it again
    assert jobs.begin(job_id, "run", owner="worker-b") == ("leased", [])
    attempts = []
    for owner in ("worker-c", "worker-d", "worker-e"):
        jobs.store.set_fields(job_id, recovery_run=jobs.store.view(job_id).attempts)  # as housekeeping marks it
        verdict, values = jobs.begin(job_id, "run", owner=owner)
        assert verdict == "ok", verdict
        attempts.append(int(values[1]))
        time.sleep(LEASE_TTL_S + 0.1)
        assert jobs.begin(job_id, "run", owner="late-duplicate") == ("leased", []), "the mark serves one delivery"
    assert attempts == [2, 3, 4]  # the 4th delivery is past max_redeliveries: the stage fails it (workers/stage.py)
    assert attempts[-1] > jobs.store.settings.max_redeliveries
    assert jobs.store.view(job_id).attempts == 4 and jobs.status(job_id) == JobStatus.running
    assert jobs.end(job_id, "run", owner="worker-e") == JobStatus.running
    assert jobs.begin(job_id, "eval", owner="worker-f")[0] == "ok", "the live delivery's end released its lease"


def test_a_begin_sent_again_by_the_same_delivery_is_answered_as_the_first_without_counting_twice(jobs: Jobs):
    job_id = jobs.create()
    first = jobs.begin(job_id, "init", owner="worker-x")  # its reply lost to a Redis restart: redis-py sends it again
    assert first[0] == "ok" and jobs.begin(job_id, "init", owner="worker-x") == first
    assert jobs.begin(job_id, "init", owner="worker-y") == ("leased", [])


def test_a_lease_that_lapsed_while_redis_was_away_is_taken_again_by_its_holder_while_its_stage_lasts(jobs: Jobs):
    job_id, other = jobs.create(), jobs.create()
    jobs.walk_to(job_id, "run")
    jobs.walk_to(other, "run")
    jobs.store.redis.delete(jobs.store.key(job_id, "lease"), jobs.store.key(other, "lease"))  # lapsed
    jobs.end(other, "run")  # ... and one stage ended meanwhile
    held = {j: (OWNER, "run", JobStatus.running) for j in (job_id, other)}
    assert jobs.store.renew_leases(held) == [other]
    assert jobs.store.redis.get(jobs.store.key(job_id, "lease")) == OWNER.encode()
    assert jobs.store.redis.get(jobs.store.key(other, "lease")) is None, "an ended stage's lease stays released"
    assert jobs.begin(job_id, "run", owner="worker-b") == ("leased", [])
    jobs.store.redis.set(jobs.store.key(job_id, "lease"), "worker-b")  # taken over by another delivery
    assert jobs.store.renew_leases({job_id: held[job_id]}) == [job_id]
    assert jobs.store.redis.get(jobs.store.key(job_id, "lease")) == b"worker-b"


def test_a_stage_handed_back_is_taken_over_by_the_next_delivery_at_once(jobs: Jobs):
    job_id = jobs.create()
    jobs.walk_to(job_id, "run")
    jobs.store.hand_back(job_id, "run", OWNER, jobs.store.view(job_id).attempts)
    assert jobs.store.redis.get(jobs.store.key(job_id, "lease")) is None
    verdict, values = jobs.begin(job_id, "run", owner="worker-b")
    assert verdict == "ok" and values[1] == "2"


def completed(jobs: Jobs) -> str:
    job_id = jobs.create()
    jobs.walk_to(job_id, "eval")
    assert jobs.end(job_id, "eval", (JobStatus.completed, {"reward": 1.0})) == JobStatus.completed
    return job_id


def in_stage(stage: str) -> Callable[[Jobs], str]:
    def make(jobs: Jobs) -> str:
        job_id = jobs.create()
        jobs.walk_to(job_id, stage)
        return job_id

    return make


def after_stage(stage: str) -> Callable[[Jobs], str]:
    def make(jobs: Jobs) -> str:
        job_id = in_stage(stage)(jobs)
        assert jobs.end(job_id, stage) is not None
        return job_id

    return make


ILLEGAL: dict[str, tuple[Callable[[Jobs], str], Callable[[Jobs, str], object], object]] = {
    "a stage that begins twice while its first delivery holds the lease is refused as leased": (
        in_stage("run"),
        lambda jobs, j: jobs.begin(j, "run", owner="worker-b")[0],
        "leased",
    ),
    "a stage that begins again after it ended is skipped": (
        after_stage("init"),
        lambda jobs, j: jobs.begin(j, "init", owner="worker-b"),
        ("skip", ["initializing"]),
    ),
    "a stage that begins out of order is skipped": (
        lambda jobs: jobs.create(),
        lambda jobs, j: jobs.begin(j, "eval"),
        ("skip", ["queued"]),
    ),
    "a stage that begins on a finished job is skipped": (
        completed,
        lambda jobs, j: jobs.begin(j, "eval", owner="worker-b"),
        ("skip", ["completed"]),
    ),
    "a second finish is refused": (
        completed,
        lambda jobs, j: jobs.store.finish(j, JobStatus.failed, TaskError("late")),
        False,
    ),
    "a second terminal stage end leaves the first": (
        completed,
        lambda jobs, j: jobs.end(j, "eval", (JobStatus.timed_out, {})),
        JobStatus.completed,
    ),
    "a cancel after completion is refused and raises no flag": (
        completed,
        lambda jobs, j: (jobs.store.cancel(j), jobs.store.cancel_requested(j)),
        (False, False),
    ),
    "a transition of a finished job is refused": (
        completed,
        lambda jobs, j: jobs.store.transition(j, JobStatus.running),
        False,
    ),
    "a transition from a status the job is not in is refused": (
        in_stage("init"),
        lambda jobs, j: jobs.store.transition(j, JobStatus.evaluating, (JobStatus.running,)),
        False,
    ),
    "a cancel of a running job does not end it there": (in_stage("run"), lambda jobs, j: jobs.store.cancel(j), False),
}


@pytest.mark.parametrize("make, act, answer", ILLEGAL.values(), ids=list(ILLEGAL))
def test_an_illegal_move_is_refused_and_changes_nothing(
    jobs: Jobs, make: Callable[[Jobs], str], act: Callable[[Jobs, str], object], answer: object
):
    job_id = make(jobs)
    before = jobs.store.view(job_id)
    announced = list(jobs.announced)
    assert act(jobs, job_id) == answer
    after = jobs.store.view(job_id)
    assert (after.status, after.reward, after.error, after.finish_reason) == (
        before.status,
        before.reward,
        before.error,
        before.finish_reason,
    )
    assert jobs.announced == announced, "a refused move announces nothing"
    assert (after.status in TERMINAL_STATUSES) == (job_id not in jobs.store.live_jobs())


def test_a_job_that_does_not_exist_is_not_found_and_no_stage_begins_it(jobs: Jobs):
    with pytest.raises(NotFound, match="never existed or its TTL expired"):
        jobs.store.finish("job-nonexistent", JobStatus.completed)
    with pytest.raises(NotFound):
        jobs.store.view("job-nonexistent")
    assert jobs.begin("job-nonexistent", "init") == ("missing", [])


def math_request(n: int = 1) -> JobRequest:
    return JobRequest.model_validate({"task": {"domain": "math", "problem": "1+1", "answer": "2"}, "n": n})


def test_each_store_tells_only_its_own_hooks_and_importing_the_workers_registers_none(
    redis_client: redis.Redis, redis_url: str
):
    import workers.dispatch  # noqa: F401  (it once registered a hook into every store when imported)

    settings = Settings(redis_url=redis_url)
    heard_a: list[tuple[str, str]] = []
    heard_b: list[tuple[str, str]] = []
    a = JobStore(redis_client, settings, on_finished=[lambda job_id, batch_id: heard_a.append((job_id, batch_id))])
    b = JobStore(redis_client, settings, on_finished=[lambda job_id, batch_id: heard_b.append((job_id, batch_id))])
    plain = JobStore(redis_client, settings)
    (first, second, third), _ = plain.create_jobs(math_request(3), batch_id="batch-x")
    (loner,), _ = plain.create_jobs(math_request())
    assert a.cancel(first)
    assert b.finish(second, JobStatus.failed, TaskError("no answer"))
    assert plain.finish(third, JobStatus.completed, reward=1.0)
    assert a.cancel(loner)
    assert not b.finish(first, JobStatus.completed), "a job ends once"
    assert plain.on_finished == []
    assert heard_a == [(first, "batch-x"), (loner, "")]
    assert heard_b == [(second, "batch-x")]


def test_the_workers_store_announces_a_batch_members_end_on_the_control_queue(
    redis_client: redis.Redis, redis_url: str, celery_app: Callable[..., Celery]
):
    app = celery_app(redis_url)
    from workers import stage

    store = stage.job_store()
    (member,), _ = store.create_jobs(math_request(), batch_id="batch-w")
    (loner,), _ = store.create_jobs(math_request())
    assert store.cancel(member) and store.cancel(loner)
    assert redis_client.llen("control") == 1, "only the batch member is announced"
    with app.connection_for_read() as connection:
        queue = connection.SimpleQueue("control", no_ack=True)
        message = queue.get(timeout=5)
        queue.close()
    assert (message.headers["task"], message.payload[0]) == ("workers.control.batch_member_done", [member])


def test_housekeeping_trims_the_index_of_expired_jobs_and_only_glances_at_it_while_none_expired(
    jobs: Jobs, redis_client: redis.Redis
):
    created = [ids[0] for ids, _ in jobs.store.create_many([math_request()] * 40)]
    redis_client.delete(*[JobStore.key(job_id) for job_id in created[:20]])  # the oldest 20 expired

    def exists_calls() -> int:
        return int(redis_client.info("commandstats").get("cmdstat_exists", {}).get("calls", 0))

    assert jobs.store.trim_job_index() == 20
    listed, _ = jobs.store.list_jobs(limit=100)
    assert {view.job_id for view in listed} >= set(created[20:])
    assert not {view.job_id for view in listed} & set(created[:20])
    before = exists_calls()
    assert jobs.store.trim_job_index() == 0
    assert exists_calls() - before <= 16  # not one EXISTS per indexed job on every sweep
