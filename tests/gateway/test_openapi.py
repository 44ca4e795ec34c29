"""schemathesis against the running gateway's /openapi.json: no input it generates, valid per the
document or not, gets a 5xx, and every answer (status, content type, headers, body) is one the
document describes. Fixed seed and a budget per route that fits CI; what it registered, paused or
submitted is undone afterwards."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis.errors import Unsatisfiable

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

EXAMPLES_PER_ROUTE_AND_MODE = 25
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]


def fuzz(operation: Any, mode: GenerationMode, checks: list, calls: list[int]) -> Callable[[], None]:
    """Hypothesis' test of one operation in one generation mode (seeded, no database)."""

    @seed(25)
    @settings(
        max_examples=EXAMPLES_PER_ROUTE_AND_MODE,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def call(case: schemathesis.Case) -> None:
        case.call_and_validate(checks=checks, timeout=90)
        calls.append(1)

    return call


def test_no_generated_request_gets_a_5xx_or_an_answer_the_document_does_not_describe(service):
    backends_before = {b["id"] for b in httpx.get(f"{service.url}/v1/backends").json()["backends"]}
    schema = schemathesis.openapi.from_url(f"{service.url}/openapi.json")
    failures: list[str] = []
    calls: list[int] = []
    try:
        for result in schema.get_all_operations():
            operation = result.ok()
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                checks = CHECKS + ([negative_data_rejection] if mode is GenerationMode.NEGATIVE else [])

                try:
                    fuzz(operation, mode, checks, calls)()
                except Unsatisfiable:  # a route without parameters or body has no invalid input
                    assert mode is GenerationMode.NEGATIVE
                except (Exception, BaseExceptionGroup) as exc:  # every operation runs; failures are reported together
                    failures.append(f"{operation.method.upper()} {operation.path} ({mode.value}): {exc}"[:3000])
    finally:
        undo_what_the_fuzzing_did(service.url, backends_before)
    assert not failures, "\n\n".join(failures)
    assert len(calls) > 400, len(calls)


def undo_what_the_fuzzing_did(url: str, backends_before: set[str]) -> None:
    for backend in httpx.get(f"{url}/v1/backends").json()["backends"]:
        if backend["id"] not in backends_before:
            httpx.delete(f"{url}/v1/backends/{backend['id']}")
    httpx.post(f"{url}/v1/backends/resume")
    for status in ("queued", "initializing", "running", "evaluating"):
        for job in httpx.get(f"{url}/v1/jobs", params={"status": status, "limit": 1000}).json()["jobs"]:
            httpx.post(f"{url}/v1/jobs/{job['job_id']}/cancel")
