"""The HTTP gateway: validates, writes the job record, enqueues the chain, answers 202.

Stateless (everything lives in Redis) and never blocks on a rollout. ``create_app`` is the
factory; it takes the door to the queues (``Enqueuer``) from its caller, and gunicorn serves
``workers.wsgi:create_app()``, which passes workers.dispatch. The routes live in
rollout_service/gateway/api/ (jobs, backends, batches, ops); this module wires them together with
authentication and the error answers.
"""

from __future__ import annotations

import hmac
import logging

import kombu.exceptions
import pydantic
import redis
from flask import Flask, Response, request
from werkzeug.exceptions import HTTPException, MethodNotAllowed, RequestEntityTooLarge

from rollout_service.errors import RequestTooLarge, RolloutError, StoreUnavailable, Unauthorized
from rollout_service.gateway.api import backends, batches, jobs, ops
from rollout_service.gateway.api.common import id_converter, public_paths, reply, route_for_endpoint
from rollout_service.schemas import validation_message
from rollout_service.settings import Settings, get_settings
from rollout_service.state.enqueue import Enqueuer

log = logging.getLogger(__name__)
BLUEPRINTS = (ops.blueprint, jobs.blueprint, backends.blueprint, batches.blueprint)


def create_app(settings: Settings | None = None, *, enqueue: Enqueuer) -> Flask:
    settings = settings or get_settings()
    app = Flask(__name__, static_folder=None)
    app.config["SETTINGS"] = settings
    app.config["ENQUEUER"] = enqueue
    app.config["MAX_CONTENT_LENGTH"] = settings.max_request_mb * 2**20
    app.url_map.converters["id"] = id_converter()
    for blueprint in BLUEPRINTS:
        app.register_blueprint(blueprint)
    public = public_paths()

    @app.before_request
    def _authenticate() -> None:
        spec = route_for_endpoint(request.endpoint)
        if not settings.api_token or (spec is not None and spec.public):
            return
        if request.routing_exception is not None and request.path in public:
            return  # a wrong method on a public route: its 405, not a 401
        header = request.headers.get("Authorization", "")
        if not hmac.compare_digest(header, f"Bearer {settings.api_token}"):
            raise Unauthorized("missing or wrong bearer token: send 'Authorization: Bearer <ROLLOUT_API_TOKEN>'")

    @app.errorhandler(RolloutError)
    def _rollout_error(exc: RolloutError) -> Response:
        return reply({"error": exc.to_dict()}, exc.http_status)

    @app.errorhandler(pydantic.ValidationError)
    def _invalid(exc: pydantic.ValidationError) -> Response:
        return reply({"error": {"code": "invalid_request", "message": validation_message(exc)}}, 400)

    @app.errorhandler(RequestEntityTooLarge)
    def _too_large(exc: RequestEntityTooLarge) -> Response:
        return _rollout_error(
            RequestTooLarge(
                f"the request body is over {settings.max_request_mb} MB (ROLLOUT_MAX_REQUEST_MB): send fewer jobs "
                "per request, or raise ROLLOUT_MAX_REQUEST_MB on the gateway"
            )
        )

    @app.errorhandler(MethodNotAllowed)
    def _wrong_method(exc: MethodNotAllowed) -> Response:
        allowed = ", ".join(sorted(exc.valid_methods or ()))
        response = reply(
            {
                "error": {
                    "code": "method_not_allowed",
                    "message": f"{request.method} is not served on {request.path}; allowed: {allowed}",
                }
            },
            405,
        )
        response.headers["Allow"] = allowed
        return response

    @app.errorhandler(HTTPException)
    def _http(exc: HTTPException) -> Response:
        return reply(
            {"error": {"code": exc.name.lower().replace(" ", "_"), "message": exc.description}}, exc.code or 500
        )

    @app.errorhandler(redis.ConnectionError)
    @app.errorhandler(redis.TimeoutError)
    @app.errorhandler(redis.ReadOnlyError)
    @app.errorhandler(kombu.exceptions.OperationalError)
    def _redis_down(exc: Exception) -> Response:
        return _rollout_error(
            StoreUnavailable(
                f"Redis is unreachable or not answering ({type(exc).__name__}: {exc}); check ROLLOUT_REDIS_URL "
                "and that Redis runs, then retry"
            )
        )

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return reply({"error": {"code": "internal_error", "message": f"{type(exc).__name__}: {exc}"}}, 500)

    return app
