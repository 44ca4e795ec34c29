"""The gateway answers bad input with a 4xx that names the problem, and describes itself."""
from __future__ import annotations

import re
import threading
import time

import httpx
import pytest
import redis


@pytest.mark.parametrize("body, status, fragment", [
    ({}, 400, "task"),
    ({"task": {"problem": "1+1"}}, 400, "domain"),
    ({"task": {"domain": "chemistry"}}, 400, "valid: code, math, stem, swe"),
    ({"task": {"domain": "math", "answer": "2"}}, 400, "task.problem"),
    ({"task": {"domain": "math", "problem": "1+1", "answer": "2"}, "n": "two"}, 400, "n"),
    ({"task": {"domain": "math", "problem": "1+1", "answer": "2"}, "n": 0}, 400, "n"),
    ({"task": {"domain": "math", "problem": "1+1", "answer": "2"}, "sampling": {"temprature": 1}}, 400,
     "sampling.temprature"),
    ({"task": {"domain": "math", "problem": "1+1", "answer": "2"}, "timeouts": {"job_s": -1}}, 400,
     "timeouts.job_s"),
])
def test_a_malformed_job_is_a_400_naming_the_problem(service, body, status, fragment):
    response = httpx.post(f"{service.url}/v1/jobs", json=body)
    assert response.status_code == status
    assert fragment in response.json()["error"]["message"]


def test_a_body_that_is_not_json_is_a_400(service):
    response = httpx.post(f"{service.url}/v1/jobs", content=b"{not json",
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert "not valid JSON" in response.json()["error"]["message"]


def test_unknown_jobs_and_routes_are_json_404s(service):
    job = httpx.get(f"{service.url}/v1/jobs/job-doesnotexist")
    route = httpx.get(f"{service.url}/v1/nothing-here")
    assert job.status_code == 404 and "job-doesnotexist" in job.json()["error"]["message"]
    assert route.status_code == 404 and route.json()["error"]["code"] == "not_found"


def test_a_backend_with_a_bad_kind_is_refused(service):
    response = httpx.post(f"{service.url}/v1/backends",
                          json={"url": "http://127.0.0.1:1", "kind": "tgi", "model": "m"})
    assert response.status_code == 400
    assert "kind" in response.json()["error"]["message"]


def test_readyz_reports_every_queue_served(service):
    body = httpx.get(f"{service.url}/readyz").json()
    assert body == {"ready": True, "redis": True, "queues": {"init": True, "run": True, "eval": True}}


def test_openapi_describes_every_flask_route_and_nothing_else(service, redis_url):
    from rollout_service.gateway import create_app
    from rollout_service.settings import Settings

    app = create_app(Settings(redis_url=redis_url))
    served = {(m.lower(), re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule))
              for rule in app.url_map.iter_rules() for m in rule.methods - {"HEAD", "OPTIONS"}}
    spec = httpx.get(f"{service.url}/openapi.json").json()
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


def test_metrics_export_queue_lengths(service):
    text = httpx.get(f"{service.url}/metrics").text
    assert 'rollout_queue_length{queue="run"}' in text


def test_bearer_auth_guards_v1_routes_when_a_token_is_set(monkeypatch, redis_url):
    from rollout_service.gateway import create_app
    from rollout_service.settings import Settings

    app = create_app(Settings(redis_url=redis_url, api_token="s3cret"))
    web = app.test_client()
    assert web.get("/v1/backends").status_code == 401
    assert web.get("/v1/backends", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert web.get("/v1/backends", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert web.get("/healthz").status_code == 200
    assert web.get("/ui/").status_code == 200  # the page is public; its API calls carry the token


def test_a_route_under_a_redis_that_stalls_answers_correctly_after_retrying(redis_client, redis_url):
    from rollout_service.gateway import create_app
    from rollout_service.schemas import JobRequest
    from rollout_service.settings import Settings
    from rollout_service.store import JobStore, redis_client as service_client

    settings = Settings(redis_url=redis_url, redis_socket_timeout_s=0.3, redis_retries=6)
    job_ids, _ = JobStore(service_client(settings), settings).create_jobs(
        JobRequest(task={"domain": "math", "problem": "1+1", "answer": "2"}))
    web = create_app(settings).test_client()
    assert web.get(f"/v1/jobs/{job_ids[0]}").status_code == 200
    stall = threading.Thread(target=lambda: redis.Redis.from_url(redis_url).execute_command("CLIENT", "PAUSE", "1000", "ALL"))
    stall.start()
    time.sleep(0.1)
    started = time.monotonic()
    response = web.get(f"/v1/jobs/{job_ids[0]}")
    stall.join()
    assert response.status_code == 200 and response.json["status"] == "queued", response.json
    assert time.monotonic() - started > 0.5  # it did meet the stall, and rode it out

    settings = Settings(redis_url=redis_url, redis_socket_timeout_s=0.2, redis_retries=1)
    web = create_app(settings).test_client()
    stall = threading.Thread(target=lambda: redis.Redis.from_url(redis_url).execute_command("CLIENT", "PAUSE", "2000", "ALL"))
    stall.start()
    time.sleep(0.1)
    response = web.get(f"/v1/jobs/{job_ids[0]}")
    stall.join()
    time.sleep(2)  # let the pause end before the next test
    assert response.status_code == 503 and response.json["error"]["code"] == "store_unavailable"
    assert "TimeoutError" in response.json["error"]["message"]


def test_a_json_body_sent_without_content_type_is_accepted_like_curl_d_sends_it(service):
    response = httpx.post(f"{service.url}/v1/jobs", content=b'{"task": {"domain": "math"}}',
                          headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert response.status_code == 400
    assert "task.problem" in response.json()["error"]["message"]


def test_a_query_parameter_that_is_not_seconds_is_a_400(service):
    response = httpx.post(f"{service.url}/v1/backends/pause?wait=soon")
    assert response.status_code == 400 and "wait='soon'" in response.json()["error"]["message"]
    assert httpx.get(f"{service.url}/v1/backends").json()["paused"] is False


JUNK_BODIES = [b"", b"null", b"[]", b"42", b'"text"', b"{}", b'{"task": null}', b'{"task": []}',
               b'{"task": {"domain": 7}}', b'{"tasks": "x", "group_size": -1}', b'{"url": 5, "kind": null}',
               b'{"task": {"domain": "math", "problem": "p", "answer": "1"}, "n": 1e300}',
               b'{"task": {"domain": "code"}, "submission": []}', b"\xff\xfe", b'{"policy_version": "new"}']
POST_ROUTES = ["/v1/jobs", "/v1/score", "/v1/batches", "/v1/backends", "/v1/backends/resume",
               "/v1/jobs/job-nope/cancel", "/v1/batches/batch-nope/cancel"]


def test_no_route_answers_malformed_input_with_a_500(service):
    for route in POST_ROUTES:
        for junk in JUNK_BODIES:
            if route == "/v1/backends/resume" and junk in (b"", b"{}"):
                continue  # a resume without a version is valid: it bumps the version
            response = httpx.post(f"{service.url}{route}", content=junk, headers={"Content-Type": "application/json"})
            assert 400 <= response.status_code < 500, (route, junk, response.status_code, response.text[:300])
            assert response.json()["error"]["message"]
    for route in ["/v1/jobs/%00", "/v1/jobs/x/trajectory", "/v1/batches/x", "/v1/batches/x/groups?after=-1",
                  "/v1/batches/x/groups?wait=nan"]:
        response = httpx.get(f"{service.url}{route}")
        assert 400 <= response.status_code < 500, (route, response.status_code, response.text[:300])
