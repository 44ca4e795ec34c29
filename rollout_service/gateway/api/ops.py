"""Operations: liveness, readiness, Prometheus metrics, the OpenAPI document and the viewer page."""

from __future__ import annotations

from importlib import resources

import redis
from flask import Blueprint, Response

from rollout_service.gateway import metrics
from rollout_service.gateway.api.common import enqueuer, reply, route, settings, store
from rollout_service.gateway.api.openapi import spec
from rollout_service.schemas import Health, Readiness
from rollout_service.state.keys import STAGES

blueprint = Blueprint("ops", __name__)


@route(blueprint, "get", "/healthz", "The process is up", response=Health, public=True, errors=())
def healthz() -> Response:
    return reply({"status": "ok"})


@route(
    blueprint,
    "get",
    "/readyz",
    "Redis reachable and every stage queue served by a worker",
    response=Readiness,
    public=True,
    errors=(503,),
    error_models=((503, Readiness),),
)
def readyz() -> Response:
    try:
        store().redis.ping()
        served = enqueuer().served_queues(store().redis)
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        return reply({"ready": False, "redis": False, "reason": str(exc)}, 503)
    missing = [q for q in STAGES if q not in served]
    body = {"ready": not missing, "redis": True, "queues": {q: q in served for q in STAGES}}
    return reply(body, 200 if not missing else 503)


@route(blueprint, "get", "/metrics", "Prometheus metrics", public=True, errors=(), content_type="text/plain")
def prometheus() -> Response:
    return Response(metrics.render(store().redis), mimetype="text/plain; version=0.0.4")


@route(blueprint, "get", "/openapi.json", "This document", public=True, errors=())
def openapi() -> Response:
    return reply(spec(token_required=bool(settings().api_token)))


@route(
    blueprint,
    "get",
    "/ui/",
    "The trajectory viewer (a static page; its API calls carry the token)",
    public=True,
    errors=(),
    content_type="text/html",
)
def viewer() -> Response:
    page = resources.files("rollout_service.gateway").joinpath("ui/index.html").read_text()
    return Response(page, mimetype="text/html")


blueprint.add_url_rule("/ui", endpoint="viewer_without_slash", redirect_to="/ui/", methods=["GET"])
