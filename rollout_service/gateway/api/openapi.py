"""``GET /openapi.json``, generated from the one route table (rollout_service/gateway/api/common.py)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel

from rollout_service import schemas
from rollout_service.gateway.api.common import ID_PATTERN, MSGPACK, ROUTES, Route

ERROR_STATUSES = {
    400: "invalid input: the message names the field and the problem",
    401: "missing or wrong bearer token",
    404: "no such job, batch or backend (or its TTL expired)",
    409: "a request with this Idempotency-Key is still being processed",
    413: "the body is over ROLLOUT_MAX_REQUEST_MB",
    415: "the body is neither application/json nor application/msgpack",
    500: "internal error (a bug: please report it with the message)",
    502: "an inference engine failed: the message and `engines` name each one and why",
    503: "store_unavailable: Redis is unreachable or not answering; retry",
    504: "the operation did not finish in time",
}
ALWAYS = (500, 503)


def spec(token_required: bool = True) -> dict[str, Any]:
    """The document of every route declared (the gateway imports every route module); without
    ``token_required`` (no ROLLOUT_API_TOKEN) no route asks for a token."""
    components: dict[str, Any] = {"ErrorInfo": schemas.ErrorInfo.model_json_schema()}
    components["Error"] = {
        "type": "object",
        "required": ["error"],
        "properties": {"error": {"$ref": "#/components/schemas/ErrorInfo"}},
    }
    paths: dict[str, dict[str, Any]] = {}
    for route in ROUTES:
        paths.setdefault(route.path, {})[route.method] = _operation(route, components, token_required)
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "rollout-service",
            "version": "1",
            "description": "JSON by default; send 'Accept: application/msgpack' for msgpack.",
        },
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "required when the service runs with ROLLOUT_API_TOKEN",
                }
            },
        },
    }
    if token_required:
        document["security"] = [{"bearer": []}]
    return document


def _operation(route: Route, components: dict[str, Any], token_required: bool) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": route.summary, "operationId": route.endpoint.replace(".", "_")}
    if route.public and token_required:
        op["security"] = []
    parameters = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string", "pattern": ID_PATTERN}}
        for name in re.findall(r"{(\w+)}", route.path)
    ]
    for query in route.query:
        schema: dict[str, Any] = {"type": query.kind}
        if query.enum:
            schema["enum"] = list(query.enum)
        for keyword, bound in (
            ("minimum", query.minimum),
            ("exclusiveMinimum", query.exclusive_minimum),
            ("maximum", query.maximum),
            ("pattern", query.pattern),
        ):
            if bound is not None:
                schema[keyword] = bound
        parameters.append(
            {"name": query.name, "in": "query", "required": False, "description": query.description, "schema": schema}
        )
    if route.idempotent:
        parameters.append(
            {
                "name": "Idempotency-Key",
                "in": "header",
                "required": False,
                "description": "a retried request with the same key returns the first answer",
                "schema": {"type": "string"},
            }
        )
    if parameters:
        op["parameters"] = parameters
    if route.request is not None:
        op["requestBody"] = {
            "required": not route.request_optional,
            "content": _content(_ref(route.request, components), msgpack=True),
        }
    ok: dict[str, Any] = {
        "description": "accepted" if route.status == 202 else "created" if route.status == 201 else "ok"
    }
    if route.response is not None:
        ok["content"] = _content(_ref(route.response, components), msgpack=route.content_type == "application/json")
    elif route.content_type != "application/json":
        ok["content"] = {route.content_type: {"schema": {"type": "string"}}}
    else:
        ok["content"] = _content({"type": "object"}, msgpack=True)
    responses: dict[str, Any] = {str(route.status): ok}
    error_models = dict(route.error_models)
    with_body = (400, 413, 415) if route.request is not None else ()
    for status in sorted(
        {*route.errors, *ALWAYS, *with_body, *((401,) if token_required and not route.public else ())}
    ):
        error = {"$ref": "#/components/schemas/Error"}
        schema = {"anyOf": [_ref(error_models[status], components), error]} if status in error_models else error
        responses[str(status)] = {"description": ERROR_STATUSES[status], "content": _content(schema, msgpack=True)}
    op["responses"] = responses
    return op


def _content(schema: dict[str, Any], msgpack: bool) -> dict[str, Any]:
    content = {"application/json": {"schema": schema}}
    if msgpack:
        content[MSGPACK] = {"schema": schema}
    return content


def _ref(model: type[BaseModel], components: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema
    return {"$ref": f"#/components/schemas/{model.__name__}"}
