"""End to end through real HTTP, real Celery workers on every queue, real Redis and real
sandboxes; only the LLM is scripted, behind the vLLM/SGLang token protocols."""

from __future__ import annotations

import time
import uuid

import httpx
import msgpack
import pytest

from rollout_service.errors import ApiError
from tests.helpers import assert_trajectory_is_exactly_what_the_server_returned, math_task, server_log, tool_call


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_a_math_job_completes_with_reward_timings_and_an_exact_trajectory(client, scripted_backend, kind):
    problem = f"What is 2 + 2? ({uuid.uuid4().hex[:6]})"
    backend = scripted_backend(
        {
            "episodes": [
                {
                    "match": problem,
                    "turns": [
                        "Let me compute.\n" + tool_call("ipython", code="print(2 + 2)"),
                        "It is \\boxed{4}.\n" + tool_call("finish", answer="\\boxed{4}"),
                    ],
                }
            ]
        },
        kind=kind,
    )
    job_id = client.submit(math_task(problem)).job_ids[0]
    (view,) = client.wait([job_id], timeout_s=120)

    assert view.status.value == "completed", view.error
    assert view.reward == 1.0 and view.finish_reason.value == "finished"
    assert all(getattr(view.timings, t) is not None for t in ("queued_s", "init_s", "run_s", "eval_s"))
    assert view.backend_id == backend.id
    trajectory = client.trajectory(job_id)
    assert trajectory.reward == 1.0 and not trajectory.truncated
    assert_trajectory_is_exactly_what_the_server_returned(trajectory, server_log(backend.url))
    tool_message = next(m for m in trajectory.messages if m["role"] == "tool")
    assert tool_message["content"].strip() == "4"


def test_a_math_job_asking_for_bash_computes_in_its_sandbox_and_is_scored_by_its_run_worker(
    client, scripted_backend, service
):
    problem = f"What is 2 + 2? ({uuid.uuid4().hex[:6]})"
    scripted_backend(
        {
            "episodes": [
                {
                    "match": problem,
                    "turns": [
                        tool_call("bash", command="echo $((2 + 2)) from $(hostname)"),
                        tool_call("finish", answer="4"),
                    ],
                }
            ]
        }
    )
    job_id = client.submit(math_task(problem), agent={"tools": ["bash", "finish"]}).job_ids[0]
    (view,) = client.wait([job_id], timeout_s=120)

    assert view.status.value == "completed" and view.reward == 1.0, view.error
    assert view.timings.sandbox_boot_s is not None
    assert not service.redis().hexists(f"rollout:job:{job_id}", "attempts_eval")  # no eval hop
    trajectory = client.trajectory(job_id)
    tool_message = next(m for m in trajectory.messages if m["role"] == "tool")
    assert tool_message["content"].splitlines()[0] == "4 from sandbox"


def test_a_math_job_skips_the_init_queue_and_its_run_worker_prepares_it_with_a_model_registered_just_now(
    client, scripted_backend, service
):
    problem = f"Skip init ({uuid.uuid4().hex[:6]})"
    script = {"episodes": [{"match": problem, "turns": ["\\boxed{4}"]}]}
    scripted_backend(script, "vllm", "first-model")
    (warm,) = client.submit(math_task(problem), sampling={"model": "first-model"}).job_ids
    client.wait([warm], timeout_s=60)  # the run worker has read the backends it prepares with
    late = scripted_backend(script, "vllm", "late-model")
    (job_id,) = client.submit(math_task(problem), sampling={"model": "late-model"}).job_ids
    (view,) = client.wait([job_id], timeout_s=60)

    assert view.status.value == "completed" and view.backend_id == late.id, view.error
    fields = {k.decode(): v.decode() for k, v in service.redis().hgetall(f"rollout:job:{job_id}").items()}
    assert fields["first_stage"] == "run" and "attempts_init" not in fields and fields["attempts_run"] == "1"
    stamps = [float(fields[f]) for f in ("created_at", "init_start", "init_end", "run_start", "run_end")]
    assert stamps == sorted(stamps)
    assert_trajectory_is_exactly_what_the_server_returned(client.trajectory(job_id), server_log(late.url))


def test_the_run_worker_scores_a_plain_number_itself_and_leaves_an_expression_to_eval(
    client, scripted_backend, service
):
    problem = f"Scored where ({uuid.uuid4().hex[:6]})"
    scripted_backend(
        {
            "episodes": [
                {"match": f"{problem} plain", "turns": [tool_call("finish", answer="\\boxed{4}")]},
                {"match": f"{problem} latex", "turns": [tool_call("finish", answer="\\boxed{\\frac{8}{2}}")]},
            ]
        }
    )
    jobs = [client.submit(math_task(f"{problem} {kind}")).job_ids[0] for kind in ("plain", "latex")]
    views = client.wait(jobs, timeout_s=60)

    assert [(v.status.value, v.reward) for v in views] == [("completed", 1.0)] * 2, [v.error for v in views]
    assert [client.trajectory(j).reward for j in jobs] == [1.0, 1.0]
    assert views[0].result["details"]["parsed_by"] == "plain_number" and "parsed_by" not in views[1].result["details"]
    hashes = [{k.decode(): v.decode() for k, v in service.redis().hgetall(f"rollout:job:{j}").items()} for j in jobs]
    assert "attempts_eval" not in hashes[0] and hashes[1]["attempts_eval"] == "1"
    for fields in hashes:
        stamps = [float(fields[f]) for f in ("run_start", "run_end", "eval_start", "eval_end")]
        assert stamps == sorted(stamps)


def test_a_wrong_answer_scores_zero_and_a_plain_text_answer_ends_with_no_tool_call(client, scripted_backend):
    problem = f"What is 2 + 3? ({uuid.uuid4().hex[:6]})"
    scripted_backend({"episodes": [{"match": problem, "turns": ["I believe it is \\boxed{6}."]}]})
    (view,) = client.wait(client.submit(math_task(problem, answer="5")).job_ids, timeout_s=120)
    assert view.status.value == "completed"
    assert view.reward == 0.0 and view.finish_reason.value == "no_tool_call"
    assert view.result["details"]["parsed_answer"]


def test_trajectory_is_served_as_msgpack_too(client, scripted_backend, service):
    problem = f"Say four ({uuid.uuid4().hex[:6]})"
    scripted_backend({"episodes": [{"match": problem, "turns": ["\\boxed{4}"]}]})
    (job_id,) = client.submit(math_task(problem)).job_ids
    client.wait([job_id], timeout_s=120)
    as_json = httpx.get(f"{service.url}/v1/jobs/{job_id}/trajectory").json()
    packed = httpx.get(f"{service.url}/v1/jobs/{job_id}/trajectory", headers={"Accept": "application/msgpack"})
    assert packed.headers["content-type"] == "application/msgpack"
    assert msgpack.unpackb(packed.content) == as_json


def test_a_group_of_n_shares_a_group_id_and_a_retried_post_returns_the_same_ids(client, scripted_backend):
    problem = f"Group of four ({uuid.uuid4().hex[:6]})"
    scripted_backend({"episodes": [{"match": problem, "turns": ["\\boxed{4}"]}]})
    key = uuid.uuid4().hex
    first = client.submit(math_task(problem), n=4, idempotency_key=key)
    again = client.submit(math_task(problem), n=4, idempotency_key=key)
    assert again == first and len(set(first.job_ids)) == 4
    views = client.wait(first.job_ids, timeout_s=120)
    assert {v.group_id for v in views} == {first.group_id}
    assert [v.reward for v in views] == [1.0] * 4


def test_a_job_for_an_unreachable_backend_fails_with_a_clear_error(client, tiny_tokenizer_dir):
    backend = client.add_backend("http://127.0.0.1:9", "vllm", "nowhere", tokenizer=str(tiny_tokenizer_dir))
    try:
        start = time.monotonic()
        (job_id,) = client.submit(math_task("2+2?"), sampling={"model": "nowhere"}, agent={"tools": ["finish"]}).job_ids
        (view,) = client.wait([job_id], timeout_s=60)
        assert view.status.value == "failed"
        assert view.error.code in ("backend_unreachable", "backend_error", "no_backend", "task_error")
        assert "127.0.0.1:9" in view.error.message or "nowhere" in view.error.message
        assert time.monotonic() - start < 45
    finally:
        client.remove_backend(backend.id)


def test_a_job_for_a_model_no_backend_serves_is_refused_at_submission_naming_the_models(client, scripted_backend):
    scripted_backend({"episodes": []}, model="only-model")
    with pytest.raises(ApiError) as err:
        client.submit(math_task("2+2?"), sampling={"model": "other-model"})
    assert err.value.http_status == 400
    assert "sampling.model 'other-model'" in str(err.value) and "only-model" in str(err.value)


def test_a_job_whose_model_left_after_submission_fails_and_says_why(client, scripted_backend):
    backend = scripted_backend({"episodes": []}, model="leaving-model")
    client.pause()  # no call starts before the backend leaves (the run worker could otherwise be quicker)
    try:
        (job_id,) = client.submit(math_task("2+2?"), sampling={"model": "leaving-model"}).job_ids
        client.remove_backend(backend.id)
    finally:
        client.resume()
    (view,) = client.wait([job_id], timeout_s=60)
    assert view.status.value == "failed"
    assert "leaving-model" in view.error.message or "no inference backend" in view.error.message


def test_cancel_ends_a_running_job_cancelled_and_keeps_its_partial_trajectory(client, scripted_backend):
    problem = f"Slow ({uuid.uuid4().hex[:6]})"
    scripted_backend(
        {"episodes": [{"match": problem, "turns": [{"text": tool_call("ipython", code="1"), "delay_s": 0.3}] * 50}]}
    )
    (job_id,) = client.submit(math_task(problem), agent={"max_turns": 50}).job_ids
    deadline = time.monotonic() + 60
    while client.get(job_id).status.value != "running" and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)
    client.cancel(job_id)
    (view,) = client.wait([job_id], timeout_s=60)
    assert view.status.value == "cancelled"
    trajectory = client.trajectory(job_id)
    assert trajectory.finish_reason.value == "cancelled" and trajectory.truncated
    assert 0 < len(trajectory.turns) < 100


def test_cancelling_a_finished_job_changes_nothing(client, scripted_backend):
    problem = f"Done ({uuid.uuid4().hex[:6]})"
    scripted_backend({"episodes": [{"match": problem, "turns": ["\\boxed{4}"]}]})
    (job_id,) = client.submit(math_task(problem)).job_ids
    client.wait([job_id], timeout_s=120)
    assert client.cancel(job_id).status.value == "completed"


def test_unknown_job_raises_a_typed_client_error(client):
    with pytest.raises(ApiError) as err:
        client.get("job-missing")
    assert err.value.http_status == 404


def test_jobs_cancelled_in_any_stage_all_reach_a_terminal_state(client, scripted_backend):
    problem = f"Cancel storm ({uuid.uuid4().hex[:6]})"
    scripted_backend(
        {"episodes": [{"match": problem, "turns": [{"text": tool_call("ipython", code="1"), "delay_s": 0.2}] * 20}]}
    )
    job_ids = client.submit(math_task(problem), n=8, agent={"max_turns": 20}).job_ids
    for number, job_id in enumerate(job_ids):
        time.sleep(0.15 * number)
        client.cancel(job_id)
    views = client.wait(job_ids, timeout_s=90)
    assert {v.status.value for v in views} <= {"cancelled", "completed"}
    assert sum(v.status.value == "cancelled" for v in views) >= 6


def test_rollouts_of_a_seeded_group_get_distinct_seeds(client, scripted_backend):
    problem = f"Seeds ({uuid.uuid4().hex[:6]})"
    backend = scripted_backend({"episodes": [{"match": problem, "turns": ["\\boxed{4}"]}]})
    client.wait(client.submit(math_task(problem), n=3, sampling={"seed": 10}).job_ids, timeout_s=120)
    assert sorted(call["params"]["seed"] for call in server_log(backend.url)) == [10, 11, 12]


def test_a_sandbox_that_cannot_start_fails_the_job_at_its_first_tool_call_and_keeps_the_first_turn(
    tmp_path, scripted_server, tiny_tokenizer_dir
):
    """The sandbox starts while the first LLM call runs; its error surfaces where the episode needs it."""
    from tests.fixtures_service import running_service

    problem = f"What is 2 + 2? ({uuid.uuid4().hex[:6]})"
    url = scripted_server(
        {
            "episodes": [
                {
                    "match": problem,
                    "turns": ["Let me compute.\n" + tool_call("ipython", code="print(2 + 2)"), "It is \\boxed{4}."],
                }
            ]
        }
    )
    with running_service(tmp_path, ROLLOUT_SANDBOX="singularity") as service, service.client() as client:
        client.add_backend(url, "vllm", "scripted", tokenizer=str(tiny_tokenizer_dir))
        job_id = client.submit(math_task(problem)).job_ids[0]  # no image: singularity cannot start
        (view,) = client.wait([job_id], timeout_s=120)
        assert view.status.value == "failed" and view.error.code == "sandbox_error", view.error
        assert "needs an image" in view.error.message
        trajectory = client.trajectory(job_id)
        assert [t.kind for t in trajectory.turns] == ["generation"] and trajectory.finish_reason.value == "error"
        assert_trajectory_is_exactly_what_the_server_returned(trajectory, server_log(url))
