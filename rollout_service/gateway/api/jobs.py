"""``/v1/jobs`` (one job or a group, in bulk, waiting, listing, trajectories) and ``/v1/score``."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import kombu.exceptions
import msgpack
from flask import Blueprint, Response, request

from rollout_service.errors import STORE_OUTAGE, ScoringTimeout, UnknownName, ValidationError
from rollout_service.gateway.api.common import (
    ID_PATTERN,
    MSGPACK,
    Query,
    body,
    check_id,
    cursor_arg,
    enqueuer,
    id_arg,
    int_arg,
    reply,
    route,
    settings,
    store,
    wants_msgpack,
)
from rollout_service.runtime.preparation import check_job
from rollout_service.schemas import (
    MAX_LIST_JOBS,
    AgentConfig,
    BulkJobRequest,
    BulkSubmitResponse,
    JobIdsRequest,
    JobList,
    JobRequest,
    JobStatus,
    JobView,
    Sampling,
    ScoreRequest,
    ScoreResponse,
    SubmitResponse,
    TrajectoriesResponse,
    Trajectory,
    WaitRequest,
    WaitResponse,
)
from rollout_service.state.backends import BackendPool
from rollout_service.state.codec import unpack
from rollout_service.state.enqueue import Enqueue
from rollout_service.state.keys import FINISHED_CHANNEL, new_id
from rollout_service.state.store import JobStore
from rollout_service.tasks import first_stage, grading_wait_s

blueprint = Blueprint("jobs", __name__)
log = logging.getLogger(__name__)
ENQUEUE_FAILURES: tuple[type[Exception], ...] = (kombu.exceptions.OperationalError, *STORE_OUTAGE)
WAIT_RECHECK_S = 0.5
WAIT_LINGER_S = 0.05  # once enough jobs ended, how long at most to wait for more ending at the same time
WAIT_QUIET_S = 0.01  # ... and how long after the last end: a wave of ends is over once they stop coming


# -- submission -------------------------------------------------------------------------
def check_rollouts(field: str, rollouts: int) -> None:
    cap = settings().max_rollouts_per_request
    if rollouts > cap:
        raise ValidationError(
            f"{field}: {rollouts} rollouts asked for, over ROLLOUT_MAX_ROLLOUTS_PER_REQUEST "
            f"({cap}); split them into several requests"
        )


def check_job_ids(job_ids: list[str]) -> None:
    for i, job_id in enumerate(job_ids):
        check_id(f"job_ids[{i}]", job_id)


def served_models(jobs: JobStore) -> list[str]:
    return BackendPool(jobs.redis).models()


def idempotent(scope: str, make: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], bool]:
    """``make()``'s response, or the one stored under this request's Idempotency-Key (then True)."""
    key = request.headers.get("Idempotency-Key")
    if key and (previous := store().claim_idempotency_key(f"{scope}{key}")) is not None:
        return previous, True
    try:
        response = make()
    except BaseException:  # nothing to answer a retry with: it may try again at once
        if key:
            with contextlib.suppress(Exception):
                store().release_idempotency_key(f"{scope}{key}")
        raise
    if key:
        store().record_idempotent_response(f"{scope}{key}", response)
    return response, False


def create_streaming(
    jobs: JobStore, requests: list[JobRequest], message_jobs: int, enqueue: Enqueue
) -> list[tuple[list[str], str]]:
    """Create and enqueue the requests' jobs a stage message at a time, so init starts on the first
    ones while the rest are still being written. Should a write fail part way, the jobs already
    created are cancelled (best effort) and the error is raised."""
    created: list[tuple[list[str], str]] = []
    part: list[JobRequest] = []
    try:
        for number, job in enumerate(requests, 1):
            part.append(job)
            if sum(r.n for r in part) >= message_jobs or number == len(requests):
                made = jobs.create_many(part)
                created += made  # before enqueueing: jobs written but never enqueued are cancelled too
                starts: dict[str, list[str]] = {}
                for asked, (job_ids, _) in zip(part, made):
                    starts.setdefault(first_stage(asked, jobs.settings), []).extend(job_ids)
                for stage, job_ids in starts.items():
                    enqueue(job_ids, stage)
                part = []
    except Exception:
        for job_ids, _ in created:
            for job_id in job_ids:
                with contextlib.suppress(Exception):
                    jobs.cancel(job_id)
        raise
    return created


# -- routes -----------------------------------------------------------------------------
@route(
    blueprint,
    "post",
    "/v1/jobs",
    "Submit a task (n > 1: a GRPO group of n rollouts)",
    request=JobRequest,
    response=SubmitResponse,
    status=202,
    idempotent=True,
    errors=(400, 409),
)
def submit() -> Response:
    job = JobRequest.model_validate(body())
    check_rollouts("n", job.n)
    check_job(job.task, job.sampling, job.agent, served_models(store()))

    def make() -> dict[str, Any]:
        job_ids, group_id = store().create_jobs(job)
        try:
            enqueuer().enqueue_jobs(job_ids, first_stage(job, store().settings))
        except ENQUEUE_FAILURES:  # the jobs exist: housekeeping sends them
            log.warning("could not enqueue %d new jobs; housekeeping will send them", len(job_ids), exc_info=True)
        return {"job_ids": job_ids, "group_id": group_id}

    return reply(idempotent("", make)[0], 202)


@route(
    blueprint,
    "post",
    "/v1/jobs/bulk",
    "Submit many jobs in one request (answers in order)",
    request=BulkJobRequest,
    response=BulkSubmitResponse,
    status=202,
    idempotent=True,
    errors=(400, 409),
)
def submit_bulk() -> Response:
    bulk = BulkJobRequest.model_validate(body())
    check_rollouts("jobs (the sum of their n)", sum(job.n for job in bulk.jobs))
    models = served_models(store())
    for i, job in enumerate(bulk.jobs):
        check_job(job.task, job.sampling, job.agent, models, where=f"jobs[{i}]")

    def make() -> dict[str, Any]:
        created = create_streaming(store(), bulk.jobs, settings().stage_batch_max_jobs, enqueuer().enqueue_jobs)
        return {"submissions": [{"job_ids": job_ids, "group_id": gid} for job_ids, gid in created]}

    return reply(idempotent("bulk:", make)[0], 202)


@route(
    blueprint,
    "post",
    "/v1/jobs/wait",
    "Long-poll until min_finished of the jobs are terminal, or timeout_s passed",
    request=WaitRequest,
    response=WaitResponse,
    errors=(400, 404),
)
def wait_jobs() -> Response:
    req = WaitRequest.model_validate(body())
    check_job_ids(req.job_ids)
    job_ids = list(dict.fromkeys(req.job_ids))
    need = min(req.min_finished, len(job_ids))
    jobs = store()
    deadline = time.monotonic() + req.timeout_s
    pubsub = jobs.redis.pubsub(ignore_subscribe_messages=True)
    try:
        pubsub.subscribe(FINISHED_CHANNEL)  # before the first check: no end can slip between
        unknown, ended = jobs.missing_and_ended(job_ids)
        if unknown:
            jobs.views(unknown)  # raises the 404 that names them
        waiting = set(job_ids).difference(ended)
        recheck_at = time.monotonic() + WAIT_RECHECK_S
        linger_until = quiet_until = math.inf
        last_end_at = time.monotonic()  # the jobs that have ended already count as ending now
        # Ends arrive as messages (a job id each); all statuses are re-read only every
        # WAIT_RECHECK_S as a fallback, so a wait on thousands of jobs costs O(ends), not O(n) per end.
        while True:
            now = time.monotonic()
            if not waiting:  # nothing left that could still end: lingering would only add its length
                break
            if len(job_ids) - len(waiting) >= need:
                linger_until = min(linger_until, now + WAIT_LINGER_S)  # gather ends arriving together,
                quiet_until = last_end_at + WAIT_QUIET_S  # until they stop coming
            if now >= min(deadline, linger_until, quiet_until):
                break
            if now >= recheck_at:
                waiting.difference_update(jobs.missing_and_ended(list(waiting))[1])
                recheck_at = now + WAIT_RECHECK_S
                continue
            message = pubsub.get_message(timeout=max(min(deadline, linger_until, quiet_until, recheck_at) - now, 0.001))
            if message and (job_id := message["data"].decode()) in waiting:
                waiting.discard(job_id)
                last_end_at = time.monotonic()
    finally:
        pubsub.close()
    finished = [j for j in job_ids if j not in waiting]
    done = set(finished)
    views = jobs.views(finished)
    return reply(
        {"finished": [v.model_dump(mode="json") for v in views], "pending": [j for j in job_ids if j not in done]}
    )


@route(
    blueprint,
    "get",
    "/v1/jobs",
    "List jobs, newest first, with filters and a cursor",
    response=JobList,
    query=(
        Query("status", "string", "only jobs in this status", tuple(s.value for s in JobStatus)),
        Query("group_id", "string", "only this group's jobs", pattern=ID_PATTERN),
        Query("batch_id", "string", "only this batch's jobs", pattern=ID_PATTERN),
        Query("limit", "integer", f"page size, 1..{MAX_LIST_JOBS} (default 100)", minimum=1, maximum=MAX_LIST_JOBS),
        Query("cursor", "string", "the cursor of the previous page", pattern="^[0-9]{1,20}$"),
    ),
)
def list_jobs() -> Response:
    raw_status = request.args.get("status")
    if raw_status is not None and raw_status not in JobStatus.__members__:
        raise UnknownName("status", raw_status, JobStatus.__members__)
    views, cursor = store().list_jobs(
        status=JobStatus(raw_status) if raw_status else None,
        group_id=id_arg("group_id"),
        batch_id=id_arg("batch_id"),
        limit=int_arg("limit", 100, 1, MAX_LIST_JOBS),
        cursor=cursor_arg("cursor"),
    )
    return reply(
        {"jobs": [v.model_dump(mode="json") for v in views], "cursor": None if cursor is None else str(cursor)}
    )


@route(
    blueprint,
    "post",
    "/v1/jobs/trajectories",
    "Many trajectories at once (msgpack recommended)",
    request=JobIdsRequest,
    response=TrajectoriesResponse,
    errors=(400, 404),
)
def trajectories() -> Response:
    req = JobIdsRequest.model_validate(body())
    check_job_ids(req.job_ids)
    job_ids = list(dict.fromkeys(req.job_ids))
    blobs = store().raw_trajectories(job_ids)
    if wants_msgpack():  # splice the stored msgpack blobs in as they are: no unpack + repack
        packer = msgpack.Packer(use_bin_type=True)
        parts = [packer.pack_map_header(1), packer.pack("trajectories"), packer.pack_map_header(len(job_ids))]
        for job_id, blob in zip(job_ids, blobs):
            parts += [packer.pack(job_id), blob if blob is not None else packer.pack(None)]
        return Response(b"".join(parts), 200, mimetype=MSGPACK)
    return reply({"trajectories": {j: None if b is None else unpack(b) for j, b in zip(job_ids, blobs)}})


@route(
    blueprint, "get", "/v1/jobs/{job_id}", "Job status, timings, reward, error, result", response=JobView, errors=(404,)
)
def get_job(job_id: str) -> Response:
    return reply(store().view(job_id).model_dump(mode="json"))


@route(
    blueprint, "get", "/v1/jobs/{job_id}/trajectory", "The token-level trajectory", response=Trajectory, errors=(404,)
)
def get_trajectory(job_id: str) -> Response:
    store().status(job_id)
    return reply(store().get_blob(job_id, "trajectory"))


@route(blueprint, "post", "/v1/jobs/{job_id}/cancel", "Cancel a job (cooperative)", response=JobView, errors=(404,))
def cancel(job_id: str) -> Response:
    return reply(cancel_job(store(), job_id).model_dump(mode="json"))


def cancel_job(jobs: JobStore, job_id: str) -> JobView:
    """Cooperative cancel: flag it; a queued job ends here (init skips it when its message comes),
    a started one at its next turn or stage start."""
    jobs.cancel(job_id)
    return jobs.view(job_id)


@route(
    blueprint,
    "post",
    "/v1/score",
    "Score a submission against a task, without an agent",
    request=ScoreRequest,
    response=ScoreResponse,
    errors=(400, 504),
)
def score() -> Response:
    req = ScoreRequest.model_validate(body())
    check_job(req.task, Sampling(), AgentConfig(), [])
    jobs = store()
    score_id = new_id("score")
    jobs.put_blob(score_id, "score-request", req.model_dump(mode="json"))
    enqueuer().submit_score(score_id)
    timeout_s = grading_wait_s(req.task, settings())
    answer = jobs.pop_within(JobStore.key(score_id, "score-result"), timeout_s)
    if answer is None:
        raise ScoringTimeout(
            f"scoring did not finish within {timeout_s:.0f} s: are eval workers running "
            "(rollout-service worker eval), or is ROLLOUT_EVAL_TIMEOUT_S too low?"
        )
    result = json.loads(answer)
    if "error" in result:
        return reply(
            result, 400 if result["error"]["code"] in ("invalid_request", "task_error", "image_error") else 500
        )
    return reply(result)
