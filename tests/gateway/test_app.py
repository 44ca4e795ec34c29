"""The gateway answers bad input with a 4xx that names the problem, and describes itself."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterable

import httpx
import pytest
import redis


class RecordingEnqueuer:
    """An ``Enqueuer`` for a gateway built in the test process: it keeps what the routes send."""

    def __init__(self, served: set[str] = frozenset()) -> None:
        self.jobs: list[tuple[list[str], str]] = []
        self.scores: list[str] = []
        self.served = set(served)
        self.finished: list[tuple[str, str]] = []

    def enqueue_jobs(self, job_ids: Iterable[str], stage: str) -> None:
        self.jobs.append((list(job_ids), stage))

    def submit_score(self, score_id: str) -> None:
        self.scores.append(score_id)

    def served_queues(self, client: redis.Redis) -> set[str]:
        return self.served

    def announce_batch_member_done(self, job_id: str, batch_id: str) -> None:
        self.finished.append((job_id, batch_id))


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        ({}, 400, "task"),
        ({"task": {"problem": "1+1"}}, 400, "domain"),
        ({"task": {"domain": "chemistry"}}, 400, "valid: code, math, stem, swe"),
        ({"task": {"domain": "math", "answer": "2"}}, 400, "task.problem"),
        ({"task": {"domain": "math", "problem": "1+1", "answer": "2"}, "n": "two"}, 400, "n"),
        ({"task": {"domain": "math", "problem": "1+1", "answer": "2"}, "n": 0}, 400, "n"),
        (
            {"task": {"domain": "math", "problem": "1+1", "answer": "2"}, "sampling": {"temprature": 1}},
            400,
            "sampling.temprature",
        ),
        (
            {"task": {"domain": "math", "problem": "1+1", "answer": "2"}, "timeouts": {"job_s": -1}},
            400,
            "timeouts.job_s",
        ),
    ],
)
def test_a_malformed_job_is_a_400_naming_the_problem(service, body, status, fragment):
    response = httpx.post(f"{service.url}/v1/jobs", json=body)
    assert response.status_code == status
    assert fragment in response.json()["error"]["message"]


def test_a_body_that_is_not_json_is_a_400(service):
    response = httpx.post(f"{service.url}/v1/jobs", content=b"{not json", headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert "not valid JSON" in response.json()["error"]["message"]


def test_unknown_jobs_and_routes_are_json_404s(service):
    job = httpx.get(f"{service.url}/v1/jobs/job-doesnotexist")
    route = httpx.get(f"{service.url}/v1/nothing-here")
    assert job.status_code == 404 and "job-doesnotexist" in job.json()["error"]["message"]
    assert route.status_code == 404 and route.json()["error"]["code"] == "not_found"


def test_a_backend_with_a_bad_kind_is_refused(service):
    response = httpx.post(f"{service.url}/v1/backends", json={"url": "http://127.0.0.1:1", "kind": "tgi", "model": "m"})
    assert response.status_code == 400
    assert "kind" in response.json()["error"]["message"]


def test_readyz_reports_every_queue_served(service):
    body = httpx.get(f"{service.url}/readyz").json()
    assert body == {"ready": True, "redis": True, "queues": {"init": True, "run": True, "eval": True}}


def test_openapi_describes_every_flask_route_and_nothing_else(service, redis_url):
    from rollout_service.gateway.app import create_app
    from rollout_service.settings import Settings

    app = create_app(Settings(redis_url=redis_url, api_token="s3cret"), enqueue=RecordingEnqueuer())
    served = {
        (m.lower(), re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule))
        for rule in app.url_map.iter_rules()
        if not rule.redirect_to
        for m in rule.methods - {"HEAD", "OPTIONS"}
    }
    spec = app.test_client().get("/openapi.json").json
    described = {(method, path) for path, ops in spec["paths"].items() for method in ops}
    assert served == described

    submit = spec["paths"]["/v1/jobs"]["post"]
    assert {p["name"] for p in submit["parameters"]} == {"Idempotency-Key"}
    assert set(submit["responses"]) >= {"202", "400", "401", "500", "503"}
    assert "application/msgpack" in submit["responses"]["202"]["content"]
    assert "application/msgpack" in submit["requestBody"]["content"]
    assert "201" in spec["paths"]["/v1/backends"]["post"]["responses"]
    assert "504" in spec["paths"]["/v1/score"]["post"]["responses"]
    listing = {p["name"]: p for p in spec["paths"]["/v1/jobs"]["get"]["parameters"]}
    assert set(listing) == {"status", "group_id", "batch_id", "limit", "cursor"}
    assert "timed_out" in listing["status"]["schema"]["enum"]
    assert spec["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert spec["paths"]["/healthz"]["get"]["security"] == [] and "security" not in submit
    for schema in ("JobRequest", "BulkJobRequest", "WaitResponse", "JobList", "TrajectoriesResponse", "Error"):
        assert schema in spec["components"]["schemas"]


def test_the_gateway_enqueues_and_reads_the_queues_through_the_enqueuer_its_factory_was_given(redis_url):
    from rollout_service.gateway.app import create_app
    from rollout_service.settings import Settings

    enqueuer = RecordingEnqueuer(served={"init", "run"})
    web = create_app(Settings(redis_url=redis_url), enqueue=enqueuer).test_client()
    task = {"domain": "math", "problem": "1+1", "answer": "2"}
    submitted = web.post("/v1/jobs", json={"task": task, "n": 2})
    assert submitted.status_code == 202, submitted.json
    assert enqueuer.jobs == [(submitted.json["job_ids"], "run")]  # math prepares cheaply: no init hop

    batch = web.post("/v1/batches", json={"tasks": [task], "group_size": 2, "target_groups": 1})
    assert batch.status_code == 202, batch.json
    assert len(enqueuer.jobs) == 2 and len(enqueuer.jobs[1][0]) == 2 and enqueuer.jobs[1][1] == "run"

    ready = web.get("/readyz")
    assert ready.status_code == 503
    assert ready.json == {"ready": False, "redis": True, "queues": {"init": True, "run": True, "eval": False}}


def test_without_a_token_the_document_asks_for_none(service):
    spec = httpx.get(f"{service.url}/openapi.json").json()
    assert "security" not in spec and "401" not in spec["paths"]["/v1/jobs"]["post"]["responses"]


def test_metrics_export_queue_lengths(service):
    text = httpx.get(f"{service.url}/metrics").text
    assert 'rollout_queue_length{queue="run"}' in text


def test_bearer_auth_guards_v1_routes_when_a_token_is_set(monkeypatch, redis_url):
    from rollout_service.gateway.app import create_app
    from rollout_service.settings import Settings

    app = create_app(Settings(redis_url=redis_url, api_token="s3cret"), enqueue=RecordingEnqueuer())
    web = app.test_client()
    assert web.get("/v1/backends").status_code == 401
    assert web.get("/v1/backends", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert web.get("/v1/backends", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert web.get("/healthz").status_code == 200
    assert web.get("/ui/").status_code == 200  # the page is public; its API calls carry the token


def test_a_route_under_a_redis_that_stalls_answers_correctly_after_retrying(redis_client, redis_url):
    from rollout_service.gateway.app import create_app
    from rollout_service.schemas import JobRequest
    from rollout_service.settings import Settings
    from rollout_service.state.connection import redis_client as service_client
    from rollout_service.state.store import JobStore

    settings = Settings(redis_url=redis_url, redis_socket_timeout_s=0.3, redis_retries=6)
    job_ids, _ = JobStore(service_client(settings), settings).create_jobs(
        JobRequest(task={"domain": "math", "problem": "1+1", "answer": "2"})
    )
    web = create_app(settings, enqueue=RecordingEnqueuer()).test_client()
    assert web.get(f"/v1/jobs/{job_ids[0]}").status_code == 200
    stall = threading.Thread(
        target=lambda: redis.Redis.from_url(redis_url).execute_command("CLIENT", "PAUSE", "1000", "ALL")
    )
    stall.start()
    time.sleep(0.1)
    started = time.monotonic()
    response = web.get(f"/v1/jobs/{job_ids[0]}")
    stall.join()
    assert response.status_code == 200 and response.json["status"] == "queued", response.json
    assert time.monotonic() - started > 0.5  # it did meet the stall, and rode it out

    settings = Settings(redis_url=redis_url, redis_socket_timeout_s=0.2, redis_retries=1)
    web = create_app(settings, enqueue=RecordingEnqueuer()).test_client()
    stall = threading.Thread(
        target=lambda: redis.Redis.from_url(redis_url).execute_command("CLIENT", "PAUSE", "2000", "ALL")
    )
    stall.start()
    time.sleep(0.1)
    response = web.get(f"/v1/jobs/{job_ids[0]}")
    stall.join()
    time.sleep(2)  # let the pause end before the next test
    assert response.status_code == 503 and response.json["error"]["code"] == "store_unavailable"
    assert "TimeoutError" in response.json["error"]["message"]


def test_a_json_body_sent_without_content_type_is_accepted_like_curl_d_sends_it(service):
    response = httpx.post(
        f"{service.url}/v1/jobs",
        content=b'{"task": {"domain": "math"}}',
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert response.status_code == 400
    assert "task.problem" in response.json()["error"]["message"]


def test_a_query_parameter_that_is_not_seconds_is_a_400(service):
    response = httpx.post(f"{service.url}/v1/backends/pause?wait=soon")
    assert response.status_code == 400 and "wait='soon'" in response.json()["error"]["message"]
    assert httpx.get(f"{service.url}/v1/backends").json()["paused"] is False


JUNK_BODIES = [
    b"",
    b"null",
    b"[]",
    b"42",
    b'"text"',
    b"{}",
    b'{"task": null}',
    b'{"task": []}',
    b'{"task": {"domain": 7}}',
    b'{"tasks": "x", "group_size": -1}',
    b'{"url": 5, "kind": null}',
    b'{"task": {"domain": "math", "problem": "p", "answer": "1"}, "n": 1e300}',
    b'{"task": {"domain": "code"}, "submission": []}',
    b"\xff\xfe",
    b'{"policy_version": "new"}',
]
POST_ROUTES = [
    "/v1/jobs",
    "/v1/score",
    "/v1/batches",
    "/v1/backends",
    "/v1/backends/resume",
    "/v1/jobs/job-nope/cancel",
    "/v1/batches/batch-nope/cancel",
]


def test_no_route_answers_malformed_input_with_a_500(service):
    for route in POST_ROUTES:
        for junk in JUNK_BODIES:
            if route == "/v1/backends/resume" and junk in (b"", b"{}"):
                continue  # a resume without a version is valid: it bumps the version
            response = httpx.post(f"{service.url}{route}", content=junk, headers={"Content-Type": "application/json"})
            assert 400 <= response.status_code < 500, (route, junk, response.status_code, response.text[:300])
            assert response.json()["error"]["message"]
    for route in [
        "/v1/jobs/%00",
        "/v1/jobs/x/trajectory",
        "/v1/batches/x",
        "/v1/batches/x/groups?after=-1",
        "/v1/batches/x/groups?wait=nan",
    ]:
        response = httpx.get(f"{service.url}{route}")
        assert 400 <= response.status_code < 500, (route, response.status_code, response.text[:300])


# -- bad input is a 4xx naming the field (issue 25, item 8) -------------------------------
MATH_TASK = {"domain": "math", "problem": "1+1", "answer": "2"}


def nested(depth: int, leaf: object = 1) -> object:
    for _ in range(depth):
        leaf = {"a": leaf}
    return leaf


def error_of(response: httpx.Response) -> str:
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    return response.json()["error"]["message"]


@pytest.mark.parametrize("ttl", ["1e17", "1.797e308", "86401", "inf"])
def test_a_pause_ttl_beyond_a_day_is_a_400_naming_ttl(service, ttl):
    response = httpx.post(f"{service.url}/v1/backends/pause", params={"ttl": ttl})
    assert response.status_code == 400 and "ttl" in error_of(response) and "86400" in error_of(response)
    assert httpx.get(f"{service.url}/v1/backends").json()["paused"] is False


def test_a_pause_wait_beyond_60_s_is_a_400_naming_wait(service):
    response = httpx.post(f"{service.url}/v1/backends/pause", params={"wait": "61"})
    assert response.status_code == 400 and "wait" in error_of(response) and "60" in error_of(response)
    assert httpx.get(f"{service.url}/v1/backends").json()["paused"] is False


def test_a_pause_that_expires_while_waiting_for_calls_answers_not_paused(service):
    from rollout_service.state.backends import BackendPool

    pool = BackendPool(service.redis())
    pool.begin_call("job-held-by-test")
    try:
        answer = httpx.post(f"{service.url}/v1/backends/pause", params={"ttl": "0.3", "wait": "1"}).json()
    finally:
        pool.end_call("job-held-by-test")
    assert answer["paused"] is False and answer["expires_in_s"] is None, answer


def test_json_nested_100k_deep_is_a_400_naming_the_depth(service):
    deep = b'{"task": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    response = httpx.post(f"{service.url}/v1/jobs", content=deep, headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and "deeper than 64" in error_of(response)


@pytest.mark.parametrize("field", ["metadata", "task"])
def test_a_task_or_metadata_nested_600_deep_is_a_400_naming_the_field(service, field):
    body = {"task": MATH_TASK, field: {**(MATH_TASK if field == "task" else {}), "x": nested(600)}}
    response = httpx.post(f"{service.url}/v1/jobs", json=body)
    assert response.status_code == 400 and f"{field}.x.a.a" in error_of(response)
    assert "deeper than 64" in error_of(response)


def test_metadata_nested_within_the_limit_is_accepted(service):
    response = httpx.post(f"{service.url}/v1/jobs", json={"task": MATH_TASK, "metadata": {"x": nested(60)}, "n": 1})
    assert response.status_code == 202, response.text
    for job_id in response.json()["job_ids"]:
        httpx.post(f"{service.url}/v1/jobs/{job_id}/cancel")


def test_msgpack_nested_100k_deep_is_a_400_that_says_so(service):
    import msgpack

    deep = b"\x81\xa4task" + b"\x91" * 100_000 + b"\xc0"
    response = httpx.post(f"{service.url}/v1/jobs", content=deep, headers={"Content-Type": "application/msgpack"})
    assert response.status_code == 400 and "deeper than" in error_of(response)
    shallow = msgpack.packb({"task": MATH_TASK, "metadata": nested(100)})
    response = httpx.post(f"{service.url}/v1/jobs", content=shallow, headers={"Content-Type": "application/msgpack"})
    assert response.status_code == 400 and "metadata.a.a" in error_of(response)


@pytest.mark.parametrize(
    "value, fragment",
    [
        ({"blob": b"\x00\x01"}, "metadata.blob: bytes"),
        ({7: "x"}, "metadata: the key 7"),
        ({"x": float("nan")}, "metadata.x: nan"),
    ],
)
def test_msgpack_values_json_cannot_carry_are_a_400_naming_the_field(service, value, fragment):
    import msgpack

    body = msgpack.packb({"task": MATH_TASK, "metadata": value}, use_bin_type=True, strict_types=False)
    response = httpx.post(f"{service.url}/v1/jobs", content=body, headers={"Content-Type": "application/msgpack"})
    assert fragment in error_of(response)


def test_a_lone_surrogate_in_a_string_is_a_400_naming_the_field(service):
    body = b'{"task": {"domain": "math", "problem": "x\\ud800", "answer": "2"}}'
    response = httpx.post(f"{service.url}/v1/jobs", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and "task.problem" in error_of(response) and "surrogate" in error_of(response)


def test_an_id_with_a_colon_is_a_4xx_naming_the_id_not_a_redis_error(service):
    from rollout_service.schemas import JobRequest
    from rollout_service.settings import Settings
    from rollout_service.state.store import JobStore

    jobs = JobStore(service.redis(), Settings.from_env(service.env))
    (job_id,), group_id = jobs.create_jobs(JobRequest(task=MATH_TASK))
    jobs.cancel(job_id)
    for route in (
        f"/v1/jobs/{job_id}:request",
        f"/v1/jobs/{job_id}:request/trajectory",
        f"/v1/batches/{job_id}:request",
        f"/v1/batches/{job_id}:request/groups",
    ):
        assert f"{job_id}:request" in error_of(httpx.get(f"{service.url}{route}")), route
    assert "job_id" in error_of(httpx.post(f"{service.url}/v1/jobs/{job_id}:request/cancel"))
    assert "backend_id" in error_of(httpx.delete(f"{service.url}/v1/backends/be-1:calls"))
    for route in ("/v1/jobs/trajectories", "/v1/jobs/wait"):
        response = httpx.post(f"{service.url}{route}", json={"job_ids": [job_id, f"{job_id}:request"]})
        assert response.status_code == 400 and "job_ids[1]" in error_of(response), route
    for name in ("group_id", "batch_id"):
        response = httpx.get(f"{service.url}/v1/jobs", params={name: f"{group_id}:jobs"})
        assert response.status_code == 400 and name in error_of(response)


# -- resource limits (issue 25, item 9) ----------------------------------------------------
def test_a_body_over_the_request_size_limit_is_a_413_naming_the_setting(redis_url):
    from rollout_service.gateway.app import create_app
    from rollout_service.settings import Settings

    web = create_app(Settings(redis_url=redis_url, max_request_mb=1), enqueue=RecordingEnqueuer()).test_client()
    body = b'{"task": {"domain": "math", "problem": "' + b"x" * 2**20 + b'", "answer": "2"}}'
    response = web.post("/v1/jobs", data=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and "ROLLOUT_MAX_REQUEST_MB" in response.json["error"]["message"]


def test_the_default_request_size_limit_is_16_mb():
    from rollout_service.settings import Settings

    assert Settings.from_env({}).max_request_mb == 16


def test_a_bulk_request_asking_for_more_rollouts_than_the_cap_is_a_400_naming_the_field(service):
    jobs = [{"task": MATH_TASK, "n": 1024}] * 17
    response = httpx.post(f"{service.url}/v1/jobs/bulk", json={"jobs": jobs})
    assert response.status_code == 400, response.text
    assert "jobs" in error_of(response) and "17408" in error_of(response)
    assert "ROLLOUT_MAX_ROLLOUTS_PER_REQUEST" in error_of(response)


def test_a_batch_asking_for_more_rollouts_than_the_cap_is_a_400_naming_the_field(service):
    response = httpx.post(
        f"{service.url}/v1/batches", json={"tasks": [MATH_TASK] * 100, "group_size": 1024, "target_groups": 100}
    )
    assert response.status_code == 400 and "target_groups" in error_of(response)
    assert "ROLLOUT_MAX_ROLLOUTS_PER_REQUEST" in error_of(response)


def test_a_batch_groups_wait_beyond_60_s_is_a_400_naming_wait(service):
    response = httpx.get(f"{service.url}/v1/batches/batch-nope/groups", params={"wait": "61"})
    assert response.status_code == 400 and "wait" in error_of(response)


# -- the OpenAPI document and validation agree (issue 25, also) ----------------------------
@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"task": MATH_TASK, "max_policy_lag": False}, "max_policy_lag"),
        ({"task": MATH_TASK, "timeouts": {"job_s": "10"}}, "timeouts.job_s"),
        ({"task": MATH_TASK, "timeouts": {"job_s": 1e-300}}, "timeouts.job_s"),
        ({"task": MATH_TASK, "n": True}, "n"),
        ({"task": MATH_TASK, "sampling": {"temperature": "0.5"}}, "sampling.temperature"),
    ],
)
def test_a_value_of_the_wrong_json_type_is_a_400_not_coerced(service, body, fragment):
    response = httpx.post(f"{service.url}/v1/jobs", json=body)
    assert response.status_code == 400 and fragment in error_of(response)


def test_an_empty_status_filter_is_a_400_naming_status(service):
    response = httpx.get(f"{service.url}/v1/jobs", params={"status": ""})
    assert response.status_code == 400 and "status" in error_of(response)


def test_a_text_plain_body_is_a_415_naming_the_accepted_types(service):
    response = httpx.post(f"{service.url}/v1/jobs", content=b'{"task": {}}', headers={"Content-Type": "text/plain"})
    assert response.status_code == 415 and "application/json" in error_of(response)


def test_the_document_says_what_validation_does(service):
    spec = httpx.get(f"{service.url}/openapi.json").json()
    schemas = spec["components"]["schemas"]
    assert schemas["JobRequest"]["properties"]["task"]["required"] == ["domain"]
    listing = {p["name"]: p["schema"] for p in spec["paths"]["/v1/jobs"]["get"]["parameters"]}
    assert listing["limit"]["minimum"] == 1 and listing["limit"]["maximum"] == 1000
    pause = {p["name"]: p["schema"] for p in spec["paths"]["/v1/backends/pause"]["post"]["parameters"]}
    assert pause["ttl"]["exclusiveMinimum"] == 0 and pause["ttl"]["maximum"] == 86400
    assert pause["wait"]["maximum"] == 60
    assert "415" in spec["paths"]["/v1/jobs"]["post"]["responses"]
    assert "413" in spec["paths"]["/v1/jobs"]["post"]["responses"]
    get_job = spec["paths"]["/v1/jobs/{job_id}"]["get"]["parameters"][0]
    assert get_job["schema"]["pattern"]


def test_a_405_says_which_methods_are_allowed(service):
    response = httpx.delete(f"{service.url}/v1/jobs/wait")
    assert response.status_code == 405 and response.headers["Allow"] == "OPTIONS, POST"
    assert response.json()["error"]["code"] == "method_not_allowed"


def test_options_advertises_only_the_methods_a_route_serves(service):
    def allowed(path: str) -> set[str]:
        return set(httpx.options(f"{service.url}{path}").headers["Allow"].split(", "))

    assert allowed("/v1/jobs/wait") == allowed("/v1/backends/pause") == {"OPTIONS", "POST"}
    assert httpx.get(f"{service.url}/v1/jobs/wait").status_code == 405


def test_a_non_get_on_a_public_route_is_a_405_even_with_a_token(redis_url):
    from rollout_service.gateway.app import create_app
    from rollout_service.settings import Settings

    web = create_app(Settings(redis_url=redis_url, api_token="s3cret"), enqueue=RecordingEnqueuer()).test_client()
    for path in ("/healthz", "/readyz", "/metrics", "/openapi.json", "/ui/", "/ui"):
        response = web.post(path)
        assert response.status_code == 405, (path, response.status_code)
        assert "GET" in response.headers["Allow"]
    assert web.post("/v1/jobs/x/nothing").status_code == 401


def test_a_queued_batch_member_cancelled_through_the_gateway_is_announced_to_its_enqueuer(redis_client, redis_url):
    from rollout_service.gateway.app import create_app
    from rollout_service.schemas import JobRequest
    from rollout_service.settings import Settings
    from rollout_service.state.connection import redis_client as service_client
    from rollout_service.state.store import JobStore

    settings = Settings(redis_url=redis_url)
    store = JobStore(service_client(settings), settings)
    request = JobRequest(task={"domain": "math", "problem": "1+1", "answer": "2"})
    (member,), _ = store.create_jobs(request, batch_id="batch-g")
    (loner,), _ = store.create_jobs(request)
    enqueuer = RecordingEnqueuer()
    web = create_app(settings, enqueue=enqueuer).test_client()
    for job_id in (member, loner):
        assert web.post(f"/v1/jobs/{job_id}/cancel").json["status"] == "cancelled"
    assert web.post(f"/v1/jobs/{member}/cancel").json["status"] == "cancelled"
    assert enqueuer.finished == [(member, "batch-g"), (loner, "")], "each end once, with its batch"
