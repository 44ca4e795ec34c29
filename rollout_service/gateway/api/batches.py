"""``/v1/batches``: GRPO groups with DAPO dynamic sampling (state and logic: rollout_service/state/batches.py)."""

from __future__ import annotations

import time

from flask import Blueprint, Response, g

from rollout_service.errors import ValidationError
from rollout_service.gateway.api.common import (
    Query,
    body,
    enqueuer,
    int_arg,
    reply,
    route,
    seconds_arg,
    settings,
    store,
)
from rollout_service.gateway.api.jobs import idempotent, served_models
from rollout_service.runtime.preparation import check_job
from rollout_service.schemas import BatchCreated, BatchGroupsPage, BatchRequest, BatchStatus, BatchView
from rollout_service.state.batches import MAX_WAIT_S, POLL_S, WIRE_EXCLUDES, BatchControl, validate

blueprint = Blueprint("batches", __name__)


def control() -> BatchControl:
    if "batch_control" not in g:
        g.batch_control = BatchControl(store(), enqueuer().enqueue_jobs)
    return g.batch_control


@route(
    blueprint,
    "post",
    "/v1/batches",
    "Submit a batch of GRPO groups with DAPO dynamic sampling",
    request=BatchRequest,
    response=BatchCreated,
    status=202,
    idempotent=True,
    errors=(400, 409),
)
def submit_batch() -> Response:
    batch = BatchRequest.model_validate(body())
    validate(batch)
    groups = max(batch.target_groups, batch.max_inflight_groups or 0)
    cap = settings().max_rollouts_per_request
    if groups * batch.group_size > cap:
        field = "target_groups" if groups == batch.target_groups else "max_inflight_groups"
        raise ValidationError(
            f"{field} x group_size = {groups} x {batch.group_size} = {groups * batch.group_size} "
            f"rollouts, over ROLLOUT_MAX_ROLLOUTS_PER_REQUEST ({cap}): ask for fewer groups "
            "per batch (submit several batches)"
        )
    models = served_models(store())
    for i, task in enumerate(batch.tasks):
        check_job(task, batch.sampling, batch.agent, models, task_at=f"tasks[{i}]")
    return reply(idempotent("batch:", lambda: {"batch_id": control().submit(batch)})[0], 202)


@route(
    blueprint,
    "get",
    "/v1/batches/{batch_id}",
    "Batch progress, counters and unused tasks",
    response=BatchView,
    errors=(404,),
)
def get_batch(batch_id: str) -> Response:
    return reply(control().batches.view(batch_id).model_dump(mode="json"))


@route(
    blueprint,
    "get",
    "/v1/batches/{batch_id}/groups",
    "Long-poll accepted groups as they complete",
    response=BatchGroupsPage,
    errors=(400, 404),
    query=(
        Query("after", "integer", "the cursor of the previous page (default 0)", minimum=0),
        Query(
            "wait",
            "number",
            f"seconds to wait for a new group, at most {MAX_WAIT_S:.0f}",
            minimum=0,
            maximum=MAX_WAIT_S,
        ),
    ),
)
def batch_groups(batch_id: str) -> Response:
    cursor = int_arg("after", 0)
    wait_s = seconds_arg("wait", 0.0, maximum=MAX_WAIT_S)
    batches = control().batches
    batches.status(batch_id)
    control().heal(batch_id)
    deadline = time.monotonic() + wait_s
    while (
        batches.accepted_count(batch_id) <= cursor
        and batches.status(batch_id) == BatchStatus.running
        and time.monotonic() < deadline
    ):
        time.sleep(POLL_S)
    page = batches.groups_after(batch_id, cursor)
    return reply(page.model_dump(mode="json", exclude=WIRE_EXCLUDES))


@route(
    blueprint,
    "post",
    "/v1/batches/{batch_id}/cancel",
    "Cancel a batch and its in-flight rollouts",
    response=BatchView,
    errors=(404,),
)
def cancel_batch(batch_id: str) -> Response:
    return reply(control().cancel(batch_id).model_dump(mode="json"))
