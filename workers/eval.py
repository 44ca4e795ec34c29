"""eval queue: score the artifact against ground truth (code runs in a fresh sandbox)."""

from __future__ import annotations

import json
import time

import redis

from rollout_service.errors import RolloutError, StoreUnavailable
from rollout_service.runtime.scoring import complete_scored
from rollout_service.schemas import JobRequest, ScoreRequest
from rollout_service.state.codec import with_field
from rollout_service.tasks import get_handler
from workers import dispatch
from workers.celery_app import app
from workers.stage import StageContext, job_store, run_stage_jobs

SCORE_RESULT_TTL_S = 600


@app.task(name=dispatch.TASK_NAMES["eval"])
def eval_jobs(job_ids: list[str]) -> None:
    run_stage_jobs(job_ids, "eval", score_job, end_each=True)  # a graded job completes at once


def score_job(ctx: StageContext) -> None:
    request, artifact, stored = (
        JobRequest.model_validate(ctx.blob("request")),
        ctx.blob("artifact"),
        ctx.raw_blob("trajectory"),
    )
    scored = get_handler(request.task["domain"]).score(request.task, artifact)
    # the trajectory as run stored it, byte for byte, but the reward
    ctx.results["trajectory"] = with_field(stored, "reward", scored.reward)
    complete_scored(ctx, artifact, scored, eval_end=time.time())


TRANSIENT = (StoreUnavailable, redis.ConnectionError, redis.TimeoutError)


@app.task(name=dispatch.SCORE_TASK, autoretry_for=TRANSIENT, retry_backoff=0.5, retry_backoff_max=5, max_retries=6)
def score_submission(score_id: str) -> None:
    """``POST /v1/score``: the eval stage alone, on a submission the caller provides. A Redis blip
    retries the task (the gateway is still waiting); only the scoring itself can fail it."""
    store = job_store()
    request = store.get_blob(score_id, "score-request")
    try:
        req = ScoreRequest.model_validate(request)
        result = get_handler(req.task["domain"]).score(req.task, req.submission).model_dump()
    except TRANSIENT:
        raise
    except RolloutError as exc:
        result = {"error": exc.to_dict()}
    except Exception as exc:
        result = {"error": {"code": "internal_error", "message": f"{type(exc).__name__}: {exc}"}}
    key = store.key(score_id, "score-result")
    pipe = store.redis.pipeline(transaction=True)
    pipe.rpush(key, json.dumps(result))
    pipe.expire(key, SCORE_RESULT_TTL_S)
    pipe.execute()
