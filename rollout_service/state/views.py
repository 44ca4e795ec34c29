"""A job's ``JobView`` built from its hash's fields: timings, waits, error, attempts."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from rollout_service.schemas import ErrorInfo, JobStatus, JobView, Timings
from rollout_service.state.keys import ATTEMPT_FIELDS, STAGE_TIMES, STAGES

VIEW_FIELDS = [
    "status",
    "group_id",
    "batch_id",
    "created_at",
    *STAGE_TIMES,
    "sandbox_boot_s",
    "sandbox_wait_s",
    "reward",
    "finish_reason",
    "error_code",
    "error_message",
    "backend_id",
    *ATTEMPT_FIELDS,
    "metadata",
]


def job_view(job_id: str, f: dict[str, str | None], result: Any) -> JobView:
    """The view of a job whose ``VIEW_FIELDS`` are ``f`` (its status is there) and result ``result``."""
    queued, spans = stage_seconds(f)
    timings = Timings(
        queued_s=sum(queued.values()) if queued else None,
        waits_s=queued,
        init_s=spans["init"],
        run_s=spans["run"],
        eval_s=spans["eval"],
        sandbox_boot_s=_float(f.get("sandbox_boot_s")),
        sandbox_wait_s=_float(f.get("sandbox_wait_s")),
    )
    error_code = f.get("error_code")
    error = ErrorInfo(code=error_code, message=f.get("error_message") or "") if error_code else None
    return JobView(
        job_id=job_id,
        status=JobStatus(f["status"]),
        group_id=f["group_id"] or "",
        timings=timings,
        reward=_float(f.get("reward")),
        finish_reason=f.get("finish_reason") or None,
        error=error,
        result=result,
        backend_id=f.get("backend_id") or None,
        attempts=max(int(f.get(name) or 0) for name in ATTEMPT_FIELDS),
        metadata=json.loads(f.get("metadata") or "{}"),
    )


def stage_seconds(f: Mapping[str, str | None]) -> tuple[dict[str, float], dict[str, float | None]]:
    """From a job hash's stamps: the wait before each stage that started (from the job's creation
    or the previous stage's end), and each stage's own span (None unless it started and ended)."""
    t = {k: _float(f.get(k)) for k in ("created_at", *STAGE_TIMES)}
    after = ("created_at", *(f"{stage}_end" for stage in STAGES[:-1]))  # what each stage waits after
    waited = {stage: _span(t[previous], t[f"{stage}_start"]) for stage, previous in zip(STAGES, after)}
    return {stage: seconds for stage, seconds in waited.items() if seconds is not None}, {
        stage: _span(t[f"{stage}_start"], t[f"{stage}_end"]) for stage in STAGES
    }


def job_names(job_ids: list[str], shown: int = 20) -> str:
    """Job ids for a message, the first ``shown`` of them."""
    more = f" and {len(job_ids) - shown} more" if len(job_ids) > shown else ""
    return ", ".join(repr(j) for j in job_ids[:shown]) + more


def _float(value: str | None) -> float | None:
    return float(value) if value else None


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start
