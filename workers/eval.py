"""eval queue: score the artifact against ground truth (code runs in a fresh sandbox)."""
from __future__ import annotations

import json
import time

from celery import Task

from rollout_service.errors import RolloutError
from rollout_service.schemas import JobStatus, ScoreRequest
from rollout_service.tasks import get_handler
from workers.celery_app import app
from workers.stage import StageContext, job_store, run_stage_task

SCORE_RESULT_TTL_S = 600


@app.task(name="workers.eval.eval_job", bind=True)
def eval_job(self: Task, job_id: str) -> None:
    run_stage_task(self, job_id, "eval", score_job)


def score_job(ctx: StageContext) -> None:
    store, job_id = ctx.store, ctx.job_id
    request = store.request(job_id)
    artifact = store.get_blob(job_id, "artifact")
    scored = get_handler(request.task["domain"]).score(request.task, artifact)
    trajectory = store.trajectory(job_id)
    trajectory.reward = scored.reward
    store.put_trajectory(job_id, trajectory)
    store.put_blob(job_id, "result", {"artifact": artifact, "details": scored.details})
    store.set_fields(job_id, eval_end=time.time())
    store.finish(job_id, JobStatus.completed, reward=scored.reward)


@app.task(name="workers.eval.score_submission")
def score_submission(score_id: str) -> None:
    """``POST /v1/score``: the eval stage alone, on a submission the caller provides."""
    store = job_store()
    try:
        req = ScoreRequest.model_validate(store.get_blob(score_id, "score-request"))
        result = get_handler(req.task["domain"]).score(req.task, req.submission).model_dump()
    except RolloutError as exc:
        result = {"error": exc.to_dict()}
    except Exception as exc:
        result = {"error": {"code": "internal_error", "message": f"{type(exc).__name__}: {exc}"}}
    key = store.key(score_id, "score-result")
    store.redis.rpush(key, json.dumps(result))
    store.redis.expire(key, SCORE_RESULT_TTL_S)
