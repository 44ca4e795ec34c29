"""Where a job's things live: its Redis keys, the job-wide sets and channels, its workspace."""

from __future__ import annotations

import uuid
from pathlib import Path

from rollout_service.settings import Settings

PREFIX = "rollout"
LIVE_JOBS = f"{PREFIX}:jobs:live"
JOB_INDEX = f"{PREFIX}:jobs:index"  # zset: job id -> creation sequence number (newest = highest)
JOB_SEQUENCE = f"{PREFIX}:jobs:seq"
FINISHED_CHANNEL = f"{PREFIX}:jobs:finished"  # pub/sub: a job id each time a job reaches a terminal state
CANCEL_CHANNEL = f"{PREFIX}:jobs:cancel"  # pub/sub: a job id each time a job's cancel flag goes up
STAGES = ("init", "run", "eval")
STAGE_TIMES = tuple(f"{stage}_{edge}" for stage in STAGES for edge in ("start", "end"))  # a job hash's stamps
ATTEMPT_FIELDS = tuple(f"attempts_{stage}" for stage in STAGES)


def recovery_field(stage: str) -> str:
    """The job field naming the delivery of ``stage`` that housekeeping (or the stage itself) gave
    up on: the one delivery after it may take the begun stage over."""
    return f"recovery_{stage}"


def job_key(job_id: str, part: str = "") -> str:
    return f"{PREFIX}:job:{job_id}" + (f":{part}" if part else "")


def group_key(group_id: str) -> str:
    return f"{PREFIX}:group:{group_id}"


def idempotency_key(key: str) -> str:
    return f"{PREFIX}:idem:{key}"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def workspace_dir(settings: Settings, job_id: str) -> Path:
    return settings.workspaces_path / job_id
