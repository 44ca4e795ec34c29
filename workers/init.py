"""init queue: everything expensive before the episode — handler, workspace, prompt ids."""

from __future__ import annotations

from rollout_service.runtime.preparation import prepare_job
from rollout_service.schemas import BackendView, JobRequest
from workers import dispatch
from workers.celery_app import app
from workers.stage import StageContext, run_stage_jobs


@app.task(name=dispatch.TASK_NAMES["init"])
def init_jobs(job_ids: list[str]) -> None:
    """The batch's jobs one after the other with no Redis round trip of their own (the stage reads
    and writes for all of them at once), so concurrent batches finish in turn instead of together."""
    backends: list[BackendView] = []  # read once per batch

    def prepare(ctx: StageContext) -> None:
        request = JobRequest.model_validate(ctx.blob("request"))
        ctx.results["prepared"] = prepare_job(ctx, request, backends).model_dump(mode="json")

    run_stage_jobs(job_ids, "init", prepare)
