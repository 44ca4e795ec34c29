"""The HTTP gateway: validates, writes the job record, enqueues the chain, answers 202.

Stateless (everything lives in Redis) and never blocks on a rollout. ``create_app`` is
the factory gunicorn serves: ``gunicorn 'rollout_service.gateway:create_app()'``.
"""
from __future__ import annotations

import hmac
import json
import logging
import time
from typing import Any

import msgpack
import pydantic
import redis
from flask import Flask, Response, g, request
from werkzeug.exceptions import HTTPException

from rollout_service import metrics
from rollout_service.backends import BackendPool
from rollout_service.batches import batches_blueprint
from rollout_service.errors import (
    RolloutError, ScoringTimeout, StoreUnavailable, Unauthorized, ValidationError,
)
from rollout_service.schemas import (
    BackendSpec, JobRequest, JobView, ResumeRequest, ScoreRequest,
)
from rollout_service.settings import Settings, get_settings
from rollout_service.store import JobStore, new_id, redis_client
from rollout_service.tasks import get_handler

log = logging.getLogger(__name__)
PUBLIC_PATHS = ("/healthz", "/readyz", "/metrics", "/openapi.json")
SERVED_QUEUES = ("init", "run", "eval")


def create_app(settings: Settings | None = None) -> Flask:
    settings = settings or get_settings()
    app = Flask(__name__)
    app.config["SETTINGS"] = settings

    def store() -> JobStore:
        if "store" not in g:
            g.store = JobStore(redis_client(settings), settings)
        return g.store

    def pool() -> BackendPool:
        return BackendPool(store().redis)

    @app.before_request
    def _authenticate() -> None:
        if not settings.api_token or request.path.startswith(PUBLIC_PATHS):
            return
        header = request.headers.get("Authorization", "")
        if not hmac.compare_digest(header, f"Bearer {settings.api_token}"):
            raise Unauthorized("missing or wrong bearer token: send 'Authorization: Bearer <ROLLOUT_API_TOKEN>'")

    @app.errorhandler(RolloutError)
    def _rollout_error(exc: RolloutError) -> Response:
        return reply({"error": exc.to_dict()}, exc.http_status)

    @app.errorhandler(pydantic.ValidationError)
    def _invalid(exc: pydantic.ValidationError) -> Response:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors())
        return reply({"error": {"code": "invalid_request", "message": problems}}, 400)

    @app.errorhandler(HTTPException)
    def _http(exc: HTTPException) -> Response:
        return reply({"error": {"code": exc.name.lower().replace(" ", "_"),
                                "message": exc.description}}, exc.code or 500)

    @app.errorhandler(redis.ConnectionError)
    def _redis_down(exc: redis.ConnectionError) -> Response:
        return _rollout_error(StoreUnavailable(f"Redis is unreachable ({exc}); check ROLLOUT_REDIS_URL"))

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return reply({"error": {"code": "internal_error", "message": f"{type(exc).__name__}: {exc}"}}, 500)

    # -- operations -----------------------------------------------------------------
    @app.get("/healthz")
    def healthz() -> Response:
        return reply({"status": "ok"})

    @app.get("/readyz")
    def readyz() -> Response:
        try:
            store().redis.ping()
        except redis.ConnectionError as exc:
            return reply({"ready": False, "redis": False, "reason": str(exc)}, 503)
        served = served_queues(store().redis)
        missing = [q for q in SERVED_QUEUES if q not in served]
        body = {"ready": not missing, "redis": True, "queues": {q: q in served for q in SERVED_QUEUES}}
        return reply(body, 200 if not missing else 503)

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(metrics.render(store().redis), mimetype="text/plain; version=0.0.4")

    @app.get("/openapi.json")
    def openapi() -> Response:
        from rollout_service.openapi import spec

        return reply(spec())

    # -- jobs -----------------------------------------------------------------------
    @app.post("/v1/jobs")
    def submit() -> Response:
        job = JobRequest.model_validate(body())
        get_handler(job.task["domain"]).validate(job.task)
        key = request.headers.get("Idempotency-Key")
        if key and (previous := store().claim_idempotency_key(key)) is not None:
            return reply(previous, 202)
        job_ids, group_id = store().create_jobs(job)
        response = {"job_ids": job_ids, "group_id": group_id}
        if key:
            store().record_idempotent_response(key, response)
        enqueue(job_ids)
        return reply(response, 202)

    @app.get("/v1/jobs/<job_id>")
    def get_job(job_id: str) -> Response:
        return reply(store().view(job_id).model_dump(mode="json"))

    @app.get("/v1/jobs/<job_id>/trajectory")
    def get_trajectory(job_id: str) -> Response:
        store().status(job_id)
        return reply(store().get_blob(job_id, "trajectory"))

    @app.post("/v1/jobs/<job_id>/cancel")
    def cancel(job_id: str) -> Response:
        return reply(cancel_job(store(), job_id).model_dump(mode="json"))

    @app.post("/v1/score")
    def score() -> Response:
        req = ScoreRequest.model_validate(body())
        get_handler(req.task["domain"]).validate(req.task)
        from workers.celery_app import app as celery

        score_id = new_id("score")
        store().put_blob(score_id, "score-request", req.model_dump(mode="json"))
        celery.signature("workers.eval.score_submission", args=(score_id,)).set(queue="eval").apply_async()
        timeout_s = settings.eval_timeout_s + 30
        answer = store().redis.blpop([JobStore.key(score_id, "score-result")], timeout=timeout_s)
        if answer is None:
            raise ScoringTimeout(f"scoring did not finish within {timeout_s:.0f} s: are eval workers running "
                                 "(rollout-service worker eval), or is ROLLOUT_EVAL_TIMEOUT_S too low?")
        result = json.loads(answer[1])
        if "error" in result:
            return reply(result, 400 if result["error"]["code"] in ("invalid_request", "task_error") else 500)
        return reply(result)

    # -- backends -------------------------------------------------------------------
    @app.post("/v1/backends")
    def add_backend() -> Response:
        spec = BackendSpec.model_validate(body())
        return reply(pool().register(spec).model_dump(), 201)

    @app.get("/v1/backends")
    def list_backends() -> Response:
        p = pool()
        return reply({"backends": [b.model_dump() for b in p.list()],
                      "paused": p.paused(), "policy_version": p.policy_version()})

    @app.delete("/v1/backends/<backend_id>")
    def delete_backend(backend_id: str) -> Response:
        pool().remove(backend_id)
        return reply({"deleted": backend_id})

    @app.post("/v1/backends/pause")
    def pause() -> Response:
        wait_s = seconds_arg("wait", 0.0)
        p = pool()
        p.pause()
        deadline = time.monotonic() + wait_s
        while p.inflight_calls() and time.monotonic() < deadline:
            time.sleep(0.02)
        return reply({"paused": True, "inflight_calls": p.inflight_calls(),
                      "policy_version": p.policy_version()})

    @app.post("/v1/backends/resume")
    def resume() -> Response:
        req = ResumeRequest.model_validate(body(default={}))
        version = pool().resume(req.policy_version)
        return reply({"paused": False, "policy_version": version})

    # -- viewer ---------------------------------------------------------------------
    @app.get("/ui/")
    def viewer() -> Response:
        from importlib import resources

        page = resources.files("rollout_service").joinpath("ui/index.html").read_text()
        return Response(page, mimetype="text/html")

    app.register_blueprint(batches_blueprint(settings))
    return app


def body(default: Any = None) -> Any:
    """The request's JSON (or msgpack) object, whatever Content-Type curl -d sent with it."""
    raw = request.get_data(cache=True, parse_form_data=False)
    if not raw:
        if default is not None:
            return default
        raise ValidationError("empty body: send a JSON object with Content-Type: application/json")
    if request.mimetype == "application/msgpack":
        try:
            return msgpack.unpackb(raw, raw=False)
        except Exception as exc:
            raise ValidationError(f"body is not valid msgpack: {exc}") from exc
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ValidationError(f"body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValidationError(f"body must be a JSON object, got {type(data).__name__}")
    return data


def seconds_arg(name: str, default: float) -> float:
    """A query parameter holding seconds (``?wait=2.5``), or a 400 that says what is wrong."""
    raw = request.args.get(name, "")
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValidationError(f"{name}={raw!r} must be a number of seconds") from None
    if value < 0:
        raise ValidationError(f"{name}={raw!r} must be >= 0 seconds")
    return value


def reply(doc: Any, status: int = 200) -> Response:
    if "application/msgpack" in request.headers.get("Accept", ""):
        return Response(msgpack.packb(doc, use_bin_type=True), status, mimetype="application/msgpack")
    return Response(json.dumps(doc), status, mimetype="application/json")


def enqueue(job_ids: list[str]) -> None:
    from workers.celery_app import pipeline_for

    for job_id in job_ids:
        pipeline_for(job_id).apply_async()


def cancel_job(store: JobStore, job_id: str) -> JobView:
    """Cooperative cancel: flag it; a queued job ends here (its links revoked), a started one
    at its next turn or stage start. Links of a started job are never revoked: a revoked
    next stage would leave the job with no one to record its end."""
    from workers.celery_app import app as celery, stage_task_ids

    if store.cancel(job_id):
        celery.control.revoke(stage_task_ids(job_id))
    return store.view(job_id)


def served_queues(client: redis.Redis) -> set[str]:
    queues: set[str] = set()
    for key in client.scan_iter("rollout:worker:*"):
        value = client.get(key)
        if value:
            queues.update(value.decode().split(","))
    return queues

