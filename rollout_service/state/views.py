"""A job's ``JobView`` built from its hash's fields: timings, waits, error, attempts."""

from __future__ import annotations

import json
from typing import Any

from rollout_service.schemas import ErrorInfo, JobStatus, JobView, Timings
from rollout_service.state.keys import STAGES

VIEW_FIELDS = [
    "status",
    "group_id",
    "batch_id",
    "created_at",
    "init_start",
    "init_end",
    "run_start",
    "run_end",
    "eval_start",
    "eval_end",
    "sandbox_boot_s",
    "sandbox_wait_s",
    "reward",
    "finish_reason",
    "error_code",
    "error_message",
    "backend_id",
    "attempts_init",
    "attempts_run",
    "attempts_eval",
    "metadata",
]


def job_view(job_id: str, f: dict[str, str | None], result: Any) -> JobView:
    """The view of a job whose ``VIEW_FIELDS`` are ``f`` (its status is there) and result ``result``."""
    t = {
        k: _float(f.get(k))
        for k in ("created_at", "init_start", "init_end", "run_start", "run_end", "eval_start", "eval_end")
    }
    waits = {
        "init": (t["created_at"], t["init_start"]),
        "run": (t["init_end"], t["run_start"]),
        "eval": (t["run_end"], t["eval_start"]),
    }
    queued = {stage: b - a for stage, (a, b) in waits.items() if a is not None and b is not None}
    timings = Timings(
        queued_s=sum(queued.values()) if queued else None,
        waits_s=queued,
        init_s=_span(t["init_start"], t["init_end"]),
        run_s=_span(t["run_start"], t["run_end"]),
        eval_s=_span(t["eval_start"], t["eval_end"]),
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
        attempts=max(int(f.get(f"attempts_{s}") or 0) for s in STAGES),
        metadata=json.loads(f.get("metadata") or "{}"),
    )


def job_names(job_ids: list[str], shown: int = 20) -> str:
    """Job ids for a message, the first ``shown`` of them."""
    more = f" and {len(job_ids) - shown} more" if len(job_ids) > shown else ""
    return ", ".join(repr(j) for j in job_ids[:shown]) + more


def _float(value: str | None) -> float | None:
    return float(value) if value else None


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start
