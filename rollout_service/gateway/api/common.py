"""What every route module shares: the route table (Flask routes and OpenAPI from one
declaration), body parsing, replies in JSON or msgpack, query arguments, and the per-request store."""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import orjson
import pydantic
from flask import Blueprint, Response, current_app, g, request
from werkzeug.routing import BaseConverter

from rollout_service.errors import NotFound, UnsupportedMediaType, ValidationError
from rollout_service.schemas import where
from rollout_service.settings import Settings
from rollout_service.state.connection import redis_client
from rollout_service.state.enqueue import Enqueuer
from rollout_service.state.store import JobStore

MSGPACK = "application/msgpack"
BODY_TYPES = (
    "application/json",
    MSGPACK,
    "application/x-msgpack",
    "application/x-www-form-urlencoded",
)  # the last: what curl -d sends with a JSON body
MAX_BODY_DEPTH = 64
ID_PATTERN = "^[A-Za-z0-9_-]{1,128}$"
_ID = re.compile(ID_PATTERN)
_CURSOR = re.compile("^[0-9]{1,20}$")


@dataclass(frozen=True)
class Query:
    name: str
    kind: str  # OpenAPI type: "string" | "number" | "integer"
    description: str
    enum: tuple[str, ...] = ()
    minimum: float | None = None
    exclusive_minimum: float | None = None
    maximum: float | None = None
    pattern: str | None = None


@dataclass(frozen=True)
class Route:
    """One HTTP route, declared once: registered with Flask and described in /openapi.json."""

    method: str
    path: str  # OpenAPI style: /v1/jobs/{job_id}
    summary: str
    endpoint: str
    request: type[pydantic.BaseModel] | None = None
    response: type[pydantic.BaseModel] | None = None
    status: int = 200
    query: tuple[Query, ...] = ()
    errors: tuple[int, ...] = (400,)
    public: bool = False
    idempotent: bool = False  # honours an Idempotency-Key header
    content_type: str = "application/json"  # of the success response (msgpack offered for JSON)
    request_optional: bool = False
    error_models: tuple[tuple[int, type[pydantic.BaseModel]], ...] = ()  # error answers whose body is not an Error

    @property
    def flask_path(self) -> str:
        return self.path.replace("{", "<id:").replace("}", ">")


ROUTES: list[Route] = []


def route(
    blueprint: Blueprint, method: str, path: str, summary: str, **details: Any
) -> Callable[[Callable[..., Response]], Callable[..., Response]]:
    """Declare a route: ``@route(bp, "post", "/v1/jobs", "Submit", request=JobRequest, status=202)``."""

    def register(view: Callable[..., Response]) -> Callable[..., Response]:
        spec = Route(method, path, summary, f"{blueprint.name}.{view.__name__}", **details)
        ROUTES.append(spec)

        @functools.wraps(view)
        def with_checked_ids(**ids: str) -> Response:
            for name, value in ids.items():
                check_id(name, value, NotFound)
            return view(**ids)

        blueprint.add_url_rule(spec.flask_path, view_func=with_checked_ids, methods=[method.upper()])
        return view

    return register


def check_id(name: str, value: str, error: type[ValidationError] | type[NotFound] = ValidationError) -> str:
    """A job, group, batch or backend id as the service hands them out, or a 4xx naming it: an id
    becomes part of a Redis key, so ``job-1:request`` must not reach another key."""
    if not _ID.match(value):
        raise error(
            f"{name} {value[:140]!r} is not an id the service hands out: ids are 1-128 letters, "
            "digits, '-' or '_' (e.g. job-5f3c0a9e1b2d4c6f)"
        )
    return value


def id_converter() -> type[BaseConverter]:
    """The ``<id:...>`` path segment: anything but the names of static siblings, so that
    ``/v1/jobs/wait`` is only ever the POST route (GET is a 405, and OPTIONS says so)."""
    reserved: set[str] = set()
    for templated in ROUTES:
        parts = templated.path.split("/")
        for i, part in enumerate(parts):
            if part.startswith("{"):
                reserved |= {
                    other[i]
                    for other in (r.path.split("/") for r in ROUTES)
                    if len(other) > i and other[:i] == parts[:i] and not other[i].startswith("{")
                }
    names = "|".join(sorted(re.escape(name) for name in reserved))
    return type(
        "IdConverter",
        (BaseConverter,),
        {"regex": f"(?!(?:{names})$)[^/]+" if names else "[^/]+", "part_isolating": True},
    )


def public_paths() -> set[str]:
    """Paths of the public routes, with and without a trailing slash."""
    return {path for r in ROUTES if r.public for path in (r.path, r.path.rstrip("/"))}


def route_for_endpoint(endpoint: str | None) -> Route | None:
    return next((r for r in ROUTES if r.endpoint == endpoint), None)


def settings() -> Settings:
    return current_app.config["SETTINGS"]


def enqueuer() -> Enqueuer:
    """The queues' door the app was built with (``create_app(..., enqueue=...)``)."""
    return current_app.config["ENQUEUER"]


def store() -> JobStore:
    if "store" not in g:
        g.store = JobStore(redis_client(settings()), settings(), on_finished=[enqueuer().announce_batch_member_done])
    return g.store


def body(default: Any = None) -> Any:
    """The request's JSON (or msgpack) object, whatever Content-Type curl -d sent with it."""
    raw = request.get_data(cache=True, parse_form_data=False)
    if not raw:
        if default is not None:
            return default
        raise ValidationError("empty body: send a JSON object with Content-Type: application/json")
    mimetype = request.mimetype
    if mimetype and mimetype not in BODY_TYPES and not mimetype.endswith("+json"):
        raise UnsupportedMediaType(
            f"Content-Type {mimetype!r} is not accepted: send the body as application/json or {MSGPACK}"
        )
    if mimetype in (MSGPACK, "application/x-msgpack"):
        try:
            data = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        except msgpack.StackError:
            raise ValidationError(f"body is nested deeper than {MAX_BODY_DEPTH} levels") from None
        except Exception as exc:
            raise ValidationError(f"body is not valid msgpack: {type(exc).__name__}: {exc}") from exc
    else:
        try:
            data = json.loads(
                raw, parse_int=_int_within_64_bits, parse_float=_finite_float, parse_constant=_no_constant
            )
        except RecursionError:
            raise ValidationError(f"body is nested deeper than {MAX_BODY_DEPTH} levels") from None
        except ValueError as exc:
            raise ValidationError(f"body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValidationError(f"body must be a JSON object, got {type(data).__name__}")
    check_document(data)
    return data


def check_document(doc: dict[str, Any]) -> None:
    """What JSON can carry and the store can keep, or a 400 naming the field: at most
    MAX_BODY_DEPTH levels, string keys, valid Unicode (no lone surrogate), finite numbers, no bytes."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(doc, ())]
    while stack:
        node, path = stack.pop()
        if len(path) >= MAX_BODY_DEPTH:
            raise ValidationError(f"{where(path)}: nested deeper than {MAX_BODY_DEPTH} levels; flatten it")
        for key, value in node.items() if type(node) is dict else enumerate(node):
            if type(node) is dict and type(key) is not str:
                raise ValidationError(f"{where(path)}: the key {key!r} is not a string; object keys are strings")
            if type(key) is str and not key.isascii():
                _check_text(key, path)
            kind = type(value)
            if kind is dict or kind is list:
                stack.append((value, (*path, key)))
            elif kind is str:
                if not value.isascii():
                    _check_text(value, (*path, key))
            elif kind is float:
                if not math.isfinite(value):
                    raise ValidationError(f"{where((*path, key))}: {value} is not a finite number")
            elif kind is not int and kind is not bool and value is not None:
                raise ValidationError(
                    f"{where((*path, key))}: {kind.__name__} is not a JSON value; "
                    "send strings, numbers, booleans, null, arrays and objects"
                )


def _check_text(text: str, path: tuple[Any, ...]) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValidationError(
            f"{where(path)}: the string holds a lone surrogate "
            f"({text[exc.start]!r}) and is not valid Unicode; send UTF-8 text"
        ) from None


def _int_within_64_bits(text: str) -> int:
    """An integer of a JSON body, refused (400) beyond 64 bits: a job's request is stored as msgpack."""
    value = int(text)
    if not -(2**63) <= value < 2**64:
        raise ValidationError(
            f"the integer {text[:40]} in the body is beyond 64 bits, which a job's "
            "request is stored in; send it as a string"
        )
    return value


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValidationError(f"the number {text[:40]} in the body is beyond a double's range")
    return value


def _no_constant(text: str) -> float:
    raise ValidationError(f"{text} in the body is not JSON: send a finite number or null")


def seconds_arg(name: str, default: float, maximum: float, positive: bool = False) -> float:
    """A query parameter holding seconds (``?wait=2.5``) within its bounds, or a 400 that says what is wrong."""
    raw = request.args.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValidationError(f"{name}={raw[:40]!r} must be a number of seconds") from None
    if positive and value == 0:
        raise ValidationError(f"{name}={raw[:40]!r}: {name} must be > 0 seconds")
    if not 0 <= value <= maximum:
        raise ValidationError(f"{name}={raw[:40]!r} must be a number of seconds between 0 and {maximum:.0f}")
    return value


def int_arg(name: str, default: int, minimum: int = 0, maximum: int | None = None) -> int:
    raw = request.args.get(name)
    if raw is None:
        return default
    if not re.fullmatch("-?[0-9]{1,20}", raw):
        raise ValidationError(f"{name}={raw[:40]!r} must be an integer")
    value = int(raw)
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise ValidationError(f"{name}={raw!r} must be {bound}")
    return value


def cursor_arg(name: str) -> int | None:
    raw = request.args.get(name)
    if raw is None:
        return None
    if not _CURSOR.match(raw):
        raise ValidationError(f"{name}={raw[:40]!r} is not a cursor: pass the '{name}' of the previous page")
    return int(raw)


def id_arg(name: str) -> str | None:
    raw = request.args.get(name)
    return None if raw is None else check_id(name, raw)


def wants_msgpack() -> bool:
    return MSGPACK in request.headers.get("Accept", "")


def reply(doc: Any, status: int = 200) -> Response:
    if wants_msgpack():
        return Response(msgpack.packb(doc, use_bin_type=True), status, mimetype=MSGPACK)
    return Response(orjson.dumps(doc, option=orjson.OPT_NON_STR_KEYS), status, mimetype="application/json")
