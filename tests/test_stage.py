"""workers/stage.py on a real Redis: how a stage begins and ends the jobs one message carries."""
from __future__ import annotations

from tests.test_api_dispatch import run_with_broker

THREE_GRADED_JOBS = """
    import json
    from rollout_service.schemas import JobRequest, JobStatus
    from workers import eval as eval_stage
    from workers.stage import job_store, run_stage_jobs

    store = job_store()
    (job_ids, _), = store.create_many([JobRequest(task={{"domain": "math", "problem": "1+1", "answer": "2"}}, n=3)])
    for job_id in job_ids:
        assert store.transition(job_id, JobStatus.running)
    seen = []

    def grade(ctx):  # what each job's grading sees of the message's jobs as it begins
        seen.append([store.status(job_id).value for job_id in job_ids])
        ctx.finish_as = (JobStatus.completed, {{"reward": 1.0}})

    {run}
    counted = sum(int(n) for field, n in store.redis.hgetall("rollout:metrics:counters").items()
                  if field.startswith(b"rollout_jobs_finished|"))
    print(json.dumps({{"seen": seen, "final": [store.status(job_id).value for job_id in job_ids], "counted": counted}}))
"""


def test_eval_completes_each_job_of_a_message_before_it_grades_the_next(redis_client, redis_url):
    result = run_with_broker(redis_url, THREE_GRADED_JOBS.format(
        run="eval_stage.score_job = grade; eval_stage.eval_jobs.run(job_ids)"))
    assert result["seen"] == [["evaluating", "evaluating", "evaluating"],
                              ["completed", "evaluating", "evaluating"],
                              ["completed", "completed", "evaluating"]]
    assert result["final"] == ["completed"] * 3 and result["counted"] == 3  # their metrics: one write at the end


def test_a_stage_that_ends_its_jobs_together_keeps_each_in_the_stage_until_the_last_is_done(
        redis_client, redis_url):
    result = run_with_broker(redis_url, THREE_GRADED_JOBS.format(run='run_stage_jobs(job_ids, "eval", grade)'))
    assert result["seen"][2] == ["evaluating"] * 3 and result["final"] == ["completed"] * 3 and result["counted"] == 3
