"""What every route module shares: the route table (Flask routes and OpenAPI from one
declaration), body parsing, replies in JSON or msgpack, query arguments, and the per-request store."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Optional

import msgpack
import orjson
import pydantic
from flask import Blueprint, Response, current_app, g, request

from rollout_service.errors import ValidationError
from rollout_service.settings import Settings
from rollout_service.store import JobStore, redis_client

MSGPACK = "application/msgpack"


@dataclass(frozen=True)
class Query:
    name: str
    kind: str  # OpenAPI type: "string" | "number" | "integer"
    description: str
    enum: tuple[str, ...] = ()


@dataclass(frozen=True)
class Route:
    """One HTTP route, declared once: registered with Flask and described in /openapi.json."""

    method: str
    path: str  # OpenAPI style: /v1/jobs/{job_id}
    summary: str
    endpoint: str
    request: Optional[type[pydantic.BaseModel]] = None
    response: Optional[type[pydantic.BaseModel]] = None
    status: int = 200
    query: tuple[Query, ...] = ()
    errors: tuple[int, ...] = (400,)
    public: bool = False
    idempotent: bool = False  # honours an Idempotency-Key header
    content_type: str = "application/json"  # of the success response (msgpack offered for JSON)
    request_optional: bool = False

    @property
    def flask_path(self) -> str:
        return self.path.replace("{", "<").replace("}", ">")


ROUTES: list[Route] = []


def route(blueprint: Blueprint, method: str, path: str, summary: str, **details: Any
          ) -> Callable[[Callable[..., Response]], Callable[..., Response]]:
    """Declare a route: ``@route(bp, "post", "/v1/jobs", "Submit", request=JobRequest, status=202)``."""
    def register(view: Callable[..., Response]) -> Callable[..., Response]:
        spec = Route(method, path, summary, f"{blueprint.name}.{view.__name__}", **details)
        ROUTES.append(spec)
        blueprint.add_url_rule(spec.flask_path, view_func=view, methods=[method.upper()])
        return view
    return register


def route_for_endpoint(endpoint: Optional[str]) -> Optional[Route]:
    return next((r for r in ROUTES if r.endpoint == endpoint), None)


def settings() -> Settings:
    return current_app.config["SETTINGS"]


def store() -> JobStore:
    if "store" not in g:
        g.store = JobStore(redis_client(settings()), settings())
    return g.store


def body(default: Any = None) -> Any:
    """The request's JSON (or msgpack) object, whatever Content-Type curl -d sent with it."""
    raw = request.get_data(cache=True, parse_form_data=False)
    if not raw:
        if default is not None:
            return default
        raise ValidationError("empty body: send a JSON object with Content-Type: application/json")
    if request.mimetype == MSGPACK:
        try:
            data = msgpack.unpackb(raw, raw=False)
        except Exception as exc:
            raise ValidationError(f"body is not valid msgpack: {exc}") from exc
    else:
        try:
            data = json.loads(raw, parse_int=_int_within_64_bits)
        except ValueError as exc:
            raise ValidationError(f"body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValidationError(f"body must be a JSON object, got {type(data).__name__}")
    return data


def _int_within_64_bits(text: str) -> int:
    """An integer of a JSON body, refused (400) beyond 64 bits: a job's request is stored as msgpack."""
    value = int(text)
    if not -2 ** 63 <= value < 2 ** 64:
        raise ValidationError(f"the integer {text[:40]} in the body is beyond 64 bits, which a job's "
                              "request is stored in; send it as a string")
    return value


def seconds_arg(name: str, default: float) -> float:
    """A query parameter holding seconds (``?wait=2.5``), or a 400 that says what is wrong."""
    raw = request.args.get(name, "")
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValidationError(f"{name}={raw!r} must be a number of seconds") from None
    if not value >= 0 or value == float("inf"):
        raise ValidationError(f"{name}={raw!r} must be a finite number of seconds >= 0")
    return value


def int_arg(name: str, default: int, minimum: int = 0, maximum: Optional[int] = None) -> int:
    raw = request.args.get(name, "")
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValidationError(f"{name}={raw!r} must be an integer") from None
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise ValidationError(f"{name}={raw!r} must be {bound}")
    return value


def wants_msgpack() -> bool:
    return MSGPACK in request.headers.get("Accept", "")


def reply(doc: Any, status: int = 200) -> Response:
    if wants_msgpack():
        return Response(msgpack.packb(doc, use_bin_type=True), status, mimetype=MSGPACK)
    return Response(orjson.dumps(doc, option=orjson.OPT_NON_STR_KEYS), status, mimetype="application/json")


def validation_message(exc: pydantic.ValidationError, prefix: str = "") -> str:
    """``jobs[3].sampling.temperature: Input should be ...`` for every problem pydantic found."""
    def where(loc: tuple[Any, ...]) -> str:
        text = prefix
        for part in loc:
            text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
        return text or "body"
    return "; ".join(f"{where(e['loc'])}: {e['msg']}" for e in exc.errors())
