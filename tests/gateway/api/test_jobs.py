"""Trainer-scale job routes end to end (real gateway, workers, Redis; scripted LLM):
bulk submit, long-poll wait, listing with filters, many trajectories at once."""

from __future__ import annotations

import dataclasses
import time
import uuid

import httpx
import msgpack
import pytest

from rollout_service.errors import ApiError
from rollout_service.gateway.api import jobs as api_jobs
from tests.helpers import math_task, tool_call


def script_for(*problems: str) -> dict:
    return {
        "episodes": [
            {
                "match": p,
                "turns": [
                    "Let me check.\n" + tool_call("ipython", code="print(2 + 2)"),
                    "\\boxed{4}\n" + tool_call("finish", answer="\\boxed{4}"),
                ],
            }
            for p in problems
        ]
    }


def test_bulk_submit_then_wait_then_trajectories_round_trip_equals_the_per_job_routes(
    client, scripted_backend, service
):
    problems = [f"Bulk {i} ({uuid.uuid4().hex[:6]})" for i in range(3)]
    scripted_backend(script_for(*problems))
    submissions = client.submit_many([{"task": math_task(p), "n": n} for p, n in zip(problems, (1, 2, 3))])
    assert [len(s.job_ids) for s in submissions] == [1, 2, 3]
    assert len({s.group_id for s in submissions}) == 3
    job_ids = [j for s in submissions for j in s.job_ids]

    seen = []
    views = client.wait(job_ids, timeout_s=120, on_done=lambda v: seen.append(v.job_id))
    assert sorted(seen) == sorted(job_ids)
    assert [v.job_id for v in views] == job_ids
    assert all(v.status.value == "completed" and v.reward == 1.0 for v in views), [v.error for v in views]

    many = client.trajectories(job_ids)
    for job_id in job_ids:
        assert many[job_id].model_dump() == client.trajectory(job_id).model_dump()
    as_json = httpx.post(f"{service.url}/v1/jobs/trajectories", json={"job_ids": job_ids[:2]}).json()
    packed = httpx.post(
        f"{service.url}/v1/jobs/trajectories", json={"job_ids": job_ids[:2]}, headers={"Accept": "application/msgpack"}
    )
    assert packed.headers["content-type"] == "application/msgpack"
    assert msgpack.unpackb(packed.content) == as_json
    assert as_json["trajectories"][job_ids[0]] == httpx.get(f"{service.url}/v1/jobs/{job_ids[0]}/trajectory").json()


def test_list_jobs_filters_by_status_group_and_batch_newest_first_with_a_cursor(client, scripted_backend):
    problem = f"Listed ({uuid.uuid4().hex[:6]})"
    scripted_backend(script_for(problem))
    first = client.submit(math_task(problem), n=3)
    second = client.submit(math_task(problem), n=2)
    client.wait(first.job_ids + second.job_ids, timeout_s=120)

    newest, cursor = client.list_jobs(limit=2)
    assert [v.job_id for v in newest] == second.job_ids[::-1] and cursor
    older, _ = client.list_jobs(limit=3, cursor=cursor)
    assert [v.job_id for v in older] == first.job_ids[::-1]
    grouped, end = client.list_jobs(group_id=first.group_id, limit=10)
    assert [v.job_id for v in grouped] == first.job_ids[::-1] and end is None
    two, more = client.list_jobs(group_id=first.group_id, limit=2)
    rest, end = client.list_jobs(group_id=first.group_id, limit=2, cursor=more)
    assert [v.job_id for v in two + rest] == first.job_ids[::-1] and end is None
    completed, _ = client.list_jobs(status="completed", limit=1000)
    assert set(first.job_ids + second.job_ids) <= {v.job_id for v in completed}
    assert client.list_jobs(status="failed", group_id=first.group_id)[0] == []
    assert client.list_jobs(batch_id="batch-none")[0] == []


def test_wait_returns_at_its_timeout_with_the_unfinished_jobs_pending(client, scripted_backend, service):
    problem = f"Slow wait ({uuid.uuid4().hex[:6]})"
    quick = f"Quick wait ({uuid.uuid4().hex[:6]})"
    scripted_backend(
        {
            "episodes": [{"match": problem, "turns": [{"text": tool_call("ipython", code="1"), "delay_s": 0.3}] * 30}]
            + script_for(quick)["episodes"]
        }
    )
    (slow_id,) = client.submit(math_task(problem), agent={"max_turns": 30}).job_ids
    (quick_id,) = client.submit(math_task(quick)).job_ids
    try:
        started = time.monotonic()
        answer = httpx.post(
            f"{service.url}/v1/jobs/wait",
            timeout=30,
            json={"job_ids": [slow_id, quick_id], "timeout_s": 60, "min_finished": 1},
        ).json()
        assert time.monotonic() - started < 50  # woke on the quick job's end, not the timeout
        assert [v["job_id"] for v in answer["finished"]] == [quick_id] and answer["pending"] == [slow_id]

        started = time.monotonic()
        answer = httpx.post(
            f"{service.url}/v1/jobs/wait", json={"job_ids": [slow_id, quick_id], "timeout_s": 1.0, "min_finished": 2}
        ).json()
        assert 0.9 < time.monotonic() - started < 5
        assert answer["pending"] == [slow_id]
        with pytest.raises(Exception, match="still running"):
            client.wait([slow_id], timeout_s=1.0)
    finally:
        client.cancel(slow_id)


def test_a_wait_whose_jobs_have_all_ended_answers_without_lingering_for_more(client, scripted_backend, service):
    problem = f"Ended wait ({uuid.uuid4().hex[:6]})"
    scripted_backend(script_for(problem))
    job_ids = client.submit(math_task(problem), n=2).job_ids
    client.wait(job_ids, timeout_s=120)
    took = []
    with httpx.Client(base_url=service.url) as http:  # one client: building one costs tens of ms of SSL set-up
        for _ in range(5):
            started = time.monotonic()
            answer = http.post("/v1/jobs/wait", json={"job_ids": job_ids, "min_finished": 1}).json()
            took.append(time.monotonic() - started)
            assert sorted(v["job_id"] for v in answer["finished"]) == sorted(job_ids) and answer["pending"] == []
    assert sorted(took)[2] < api_jobs.WAIT_LINGER_S * 0.8, took  # lingering alone takes WAIT_LINGER_S


def test_a_wait_answers_once_ends_stop_coming_not_a_whole_linger_later(client, scripted_backend, service):
    """The last jobs of a step are seen WAIT_QUIET_S after they end, not WAIT_LINGER_S."""
    problem, slow = f"Quiet wait ({uuid.uuid4().hex[:6]})", f"Still running ({uuid.uuid4().hex[:6]})"
    scripted_backend(
        {
            "episodes": script_for(problem)["episodes"]
            + [{"match": slow, "turns": [{"text": tool_call("ipython", code="1"), "delay_s": 0.3}] * 30}]
        }
    )
    ended = client.submit(math_task(problem), n=2).job_ids
    client.wait(ended, timeout_s=120)
    (running,) = client.submit(math_task(slow), agent={"max_turns": 30}).job_ids
    took = []
    try:
        with httpx.Client(base_url=service.url) as http:
            for _ in range(5):
                started = time.monotonic()
                answer = http.post("/v1/jobs/wait", json={"job_ids": [*ended, running], "min_finished": 1}).json()
                took.append(time.monotonic() - started)
                assert answer["pending"] == [running]
    finally:
        client.cancel(running)
    assert api_jobs.WAIT_QUIET_S <= sorted(took)[2] < api_jobs.WAIT_LINGER_S * 0.8, took


def test_a_bulk_submission_is_enqueued_a_stage_message_at_a_time_and_a_failed_write_cancels_what_it_made(service):
    from rollout_service.schemas import JobRequest
    from rollout_service.settings import Settings
    from rollout_service.state.keys import JOB_INDEX
    from rollout_service.state.store import JobStore

    class FailingThirdWrite(JobStore):
        writes = 0

        def create_many(self, requests, group_id=None, batch_id=""):
            FailingThirdWrite.writes += 1
            if FailingThirdWrite.writes == 3:
                raise ConnectionError("redis went away")
            return super().create_many(requests, group_id, batch_id)

    enqueued: list[list[str]] = []
    stages: list[str] = []

    def record(job_ids: list[str], stage: str) -> None:
        enqueued.append(job_ids)
        stages.append(stage)

    requests = [JobRequest(task=math_task("1+1"), n=n) for n in (3, 2, 4, 1, 5, 2)]
    jobs = JobStore(service.redis(), Settings.from_env(service.env))

    made = api_jobs.create_streaming(jobs, requests[:4], message_jobs=4, enqueue=record)
    assert [len(ids) for ids, _ in made] == [3, 2, 4, 1]
    assert enqueued == [made[0][0] + made[1][0], made[2][0], made[3][0]]  # each message once it holds 4 jobs
    assert stages == ["run"] * 3  # math prepares cheaply: its jobs skip init (tasks.first_stage)
    stages.clear()
    api_jobs.create_streaming(
        JobStore(jobs.redis, dataclasses.replace(jobs.settings, init_in_run=False)),
        requests[:1],
        message_jobs=4,
        enqueue=record,
    )
    assert stages == ["init"]

    enqueued.clear()
    with pytest.raises(ConnectionError):
        api_jobs.create_streaming(
            FailingThirdWrite(service.redis(), jobs.settings), requests, message_jobs=4, enqueue=record
        )
    assert len(enqueued) == 2 and all(jobs.status(j).value == "cancelled" for ids in enqueued for j in ids)

    def broker_down_at_second_message(job_ids, stage):
        if enqueued:
            raise ConnectionError("broker went away")
        enqueued.append(job_ids)

    enqueued.clear()
    with pytest.raises(ConnectionError):
        api_jobs.create_streaming(jobs, requests, message_jobs=4, enqueue=broker_down_at_second_message)
    written = jobs.redis.zrange(JOB_INDEX, -9, -1)  # the last 9 jobs written: 5 enqueued, 4 not
    assert len(enqueued[0]) == 5 and all(jobs.status(j.decode()).value == "cancelled" for j in written)


@pytest.mark.parametrize(
    "route, body, fragment",
    [
        ("/v1/jobs/bulk", {"jobs": []}, "jobs: List should have at least 1 item"),
        (
            "/v1/jobs/bulk",
            {"jobs": [{"task": math_task("1+1")}, {"task": {"domain": "math", "answer": "2"}}]},
            "jobs[1].task.problem",
        ),
        (
            "/v1/jobs/bulk",
            {"jobs": [{"task": math_task("1+1")}, {"task": math_task("1"), "sampling": {"top_p": 5}}]},
            "jobs[1].sampling.top_p",
        ),
        (
            "/v1/jobs/bulk",
            {"jobs": [{"task": math_task("1+1"), "agent": {"tools": ["editor"]}}]},
            "jobs[0].agent.tools ['editor'] are not offered by domain 'math' (jobs[0].task); it offers ['ipython', 'bash', 'finish']",
        ),
        (
            "/v1/jobs",
            {"task": math_task("1+1"), "agent": {"tool_parser": "xml"}},
            "agent.tool_parser 'xml' is unknown; valid: hermes",
        ),
        (
            "/v1/jobs",
            {"task": math_task("1+1"), "agent": {"tools": ["editor", "finish"]}},
            "agent.tools ['editor'] are not offered by domain 'math'",
        ),
        ("/v1/jobs", {"task": {"domain": "chemistry"}}, "task.domain: unknown domain 'chemistry'"),
        (
            "/v1/batches",
            {"tasks": [math_task("1")], "group_size": 2, "target_groups": 1, "agent": {"tools": ["editor"]}},
            "agent.tools ['editor'] are not offered by domain 'math' (tasks[0])",
        ),
        (
            "/v1/jobs/wait",
            {"job_ids": ["job-x"], "timeout_s": 61},
            "timeout_s: Input should be less than or equal to 60",
        ),
        ("/v1/jobs/wait", {"job_ids": []}, "job_ids: List should have at least 1 item"),
        ("/v1/jobs/trajectories", {"job_ids": "job-x"}, "job_ids: Input should be a valid list"),
    ],
)
def test_bad_submissions_are_400s_naming_the_field(service, route, body, fragment):
    response = httpx.post(f"{service.url}{route}", json=body)
    assert response.status_code == 400, response.text
    assert fragment in response.json()["error"]["message"]


def test_an_unknown_or_missing_model_is_a_400_listing_the_served_models(client, scripted_backend, service):
    scripted_backend({"episodes": []}, model="alpha")
    scripted_backend({"episodes": []}, model="beta")
    missing = httpx.post(f"{service.url}/v1/jobs", json={"task": math_task("1")})
    unknown = httpx.post(
        f"{service.url}/v1/jobs/bulk",
        json={
            "jobs": [
                {"task": math_task("1"), "sampling": {"model": "alpha"}},
                {"task": math_task("1"), "sampling": {"model": "gamma"}},
            ]
        },
    )
    assert missing.status_code == 400 and "sampling.model is required" in missing.json()["error"]["message"]
    assert "['alpha', 'beta']" in missing.json()["error"]["message"]
    assert unknown.status_code == 400
    assert (
        "jobs[1].sampling.model 'gamma' is not served; registered models: ['alpha', 'beta']"
        in unknown.json()["error"]["message"]
    )


def test_bad_list_arguments_and_unknown_ids_name_the_problem(service):
    status = httpx.get(f"{service.url}/v1/jobs?status=done")
    assert status.status_code == 400 and "unknown status 'done'; valid: cancelled, completed" in status.text
    assert httpx.get(f"{service.url}/v1/jobs?limit=1001").status_code == 400
    assert "cursor='x'" in httpx.get(f"{service.url}/v1/jobs?cursor=x").json()["error"]["message"]
    for route in ("/v1/jobs/wait", "/v1/jobs/trajectories"):
        response = httpx.post(f"{service.url}{route}", json={"job_ids": ["job-nope1", "job-nope2"]})
        assert response.status_code == 404 and "'job-nope1', 'job-nope2'" in response.json()["error"]["message"]


def test_a_retried_bulk_submission_with_an_idempotency_key_returns_the_same_jobs(client, scripted_backend):
    problem = f"Idem bulk ({uuid.uuid4().hex[:6]})"
    scripted_backend(script_for(problem))
    key = uuid.uuid4().hex
    first = client.submit_many([{"task": math_task(problem)}] * 2, idempotency_key=key)
    again = client.submit_many([{"task": math_task(problem)}] * 2, idempotency_key=key)
    assert first == again
    client.wait([j for s in first for j in s.job_ids], timeout_s=120)


def test_a_submission_whose_key_a_killed_gateway_left_claimed_goes_through_once_the_claim_lapses(
    client, scripted_backend, service
):
    problem = f"Idem claim ({uuid.uuid4().hex[:6]})"
    scripted_backend(script_for(problem))
    key = uuid.uuid4().hex
    service.redis().set(f"rollout:idem:{key}", "", ex=12)  # claimed by a request whose gateway died
    began = time.monotonic()
    first = client.submit(math_task(problem), n=2, idempotency_key=key)  # 409 "still being processed", then tried again
    assert time.monotonic() - began >= 10, "it waited for the claim to lapse"
    assert client.submit(math_task(problem), n=2, idempotency_key=key) == first
    assert [v.status.value for v in client.wait(first.job_ids, timeout_s=120)] == ["completed"] * 2


def test_a_thousand_trajectories_of_8k_tokens_arrive_through_the_client_in_one_call_exactly(client, service):
    from rollout_service.schemas import JobRequest, Trajectory, Turn
    from rollout_service.settings import Settings
    from rollout_service.state.store import JobStore

    jobs = JobStore(service.redis(), Settings.from_env(service.env))
    created = jobs.create_many([JobRequest(task=math_task("x"), n=1000)])
    job_ids = created[0][0]
    tokens = 8192
    trajectory = Trajectory(
        prompt_ids=list(range(512)),
        response_ids=[i % 50000 for i in range(tokens)],
        loss_mask=[1, 0] * (tokens // 2),
        logprobs=[-0.125 * (i % 7) for i in range(tokens)],
        turns=[Turn(start=0, end=tokens, kind="generation")],
        reward=1.0,
    )
    blob = msgpack.packb(trajectory.model_dump(mode="json"), use_bin_type=True)
    pipe = jobs.redis.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.set(jobs.key(job_id, "trajectory"), blob, ex=600)
        pipe.hset(jobs.key(job_id), "status", "cancelled")  # nobody should run these
        pipe.srem("rollout:jobs:live", job_id)
    pipe.execute()

    started = time.monotonic()  # the speed is bench/scale.py's (--filler-tokens 8000), not this test's
    fetched = client.trajectories(job_ids)
    print(f"1000 trajectories of 8k tokens through the client: {time.monotonic() - started:.2f} s")
    assert len(fetched) == 1000 and fetched[job_ids[-1]].response_ids == trajectory.response_ids
    assert fetched[job_ids[0]].logprobs == trajectory.logprobs and fetched[job_ids[0]].turns == trajectory.turns
    with pytest.raises(ApiError):
        client.trajectories(job_ids[:1] + ["job-nope"])


def test_a_jobs_metadata_comes_back_as_it_was_sent_and_an_integer_beyond_64_bits_is_a_400(
    client, scripted_backend, service
):
    problem = f"Metadata ({uuid.uuid4().hex[:6]})"
    scripted_backend(script_for(problem))
    too_big = httpx.post(f"{service.url}/v1/jobs", json={"task": math_task(problem), "metadata": {"step": 2**70}})
    assert too_big.status_code == 400 and "1180591620717411303424" in too_big.json()["error"]["message"], too_big.text
    metadata = {"step": 2**63 - 1, "tag": "x", "lr": 1e-6}
    answer = httpx.post(f"{service.url}/v1/jobs", json={"task": math_task(problem), "metadata": metadata})
    assert answer.status_code == 202, answer.text
    (job_id,) = answer.json()["job_ids"]
    client.wait([job_id], timeout_s=120)
    assert httpx.get(f"{service.url}/v1/jobs/{job_id}").json()["metadata"] == metadata
    assert client.get(job_id).metadata == metadata
