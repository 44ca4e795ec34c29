"""``GET /openapi.json``: every route, with request/response schemas from the wire contract."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from rollout_service import schemas

ROUTES: list[tuple[str, str, str, type[BaseModel] | None, type[BaseModel] | None]] = [
    ("post", "/v1/jobs", "Submit a task (n > 1: a GRPO group)", schemas.JobRequest, schemas.SubmitResponse),
    ("get", "/v1/jobs/{job_id}", "Job status, timings, reward", None, schemas.JobView),
    ("get", "/v1/jobs/{job_id}/trajectory", "Token-level trajectory", None, schemas.Trajectory),
    ("post", "/v1/jobs/{job_id}/cancel", "Cancel a job", None, schemas.JobView),
    ("post", "/v1/score", "Score a submission without an agent", schemas.ScoreRequest, schemas.ScoreResponse),
    ("post", "/v1/backends", "Register an inference backend", schemas.BackendSpec, schemas.BackendView),
    ("get", "/v1/backends", "List backends with live assignment counts", None, None),
    ("delete", "/v1/backends/{backend_id}", "Remove a backend", None, None),
    ("post", "/v1/backends/pause", "Stop new LLM calls (weight sync)", None, None),
    ("post", "/v1/backends/resume", "Resume LLM calls under a policy version", schemas.ResumeRequest, None),
    ("get", "/healthz", "Process is up", None, None),
    ("get", "/readyz", "Redis reachable and every queue served", None, None),
    ("get", "/metrics", "Prometheus metrics", None, None),
]


ACCEPTED = {("post", "/v1/jobs"), ("post", "/v1/batches")}


def spec() -> dict[str, Any]:
    from rollout_service.batches import OPENAPI_ROUTES

    paths: dict[str, dict[str, Any]] = {}
    components: dict[str, Any] = {}
    error = {"description": "error", "content": {"application/json": {"schema": {
        "type": "object", "properties": {"error": {"$ref": "#/components/schemas/ErrorInfo"}}}}}}
    components["ErrorInfo"] = schemas.ErrorInfo.model_json_schema()
    for method, path, summary, body, response in ROUTES + OPENAPI_ROUTES:
        op: dict[str, Any] = {"summary": summary, "responses": {"4XX": error}}
        if body is not None:
            components[body.__name__] = _schema(body, components)
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{body.__name__}"}}}}
        ok: dict[str, Any] = {"description": "ok"}
        if response is not None:
            components[response.__name__] = _schema(response, components)
            ok["content"] = {"application/json": {"schema": {"$ref": f"#/components/schemas/{response.__name__}"}}}
        op["responses"]["202" if (method, path) in ACCEPTED else "200"] = ok
        params = [p.strip("{}") for p in path.split("/") if p.startswith("{")]
        if params:
            op["parameters"] = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
                                for p in params]
        paths.setdefault(path, {})[method] = op
    return {"openapi": "3.1.0", "info": {"title": "rollout-service", "version": "1"},
            "paths": paths, "components": {"schemas": components}}


def _schema(model: type[BaseModel], components: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(schema.pop("$defs", {}))
    return schema
