"""A job's LLM calls on the backend pool: sticky, moved off a dead server, gated by weight syncs."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import httpx

from rollout_service.devtools.redis_server import free_port
from rollout_service.devtools.reference_server import ReferenceServerProcess
from tests.helpers import (
    assert_trajectory_is_exactly_what_the_server_returned,
    math_task,
    server_log,
    slow_script,
    tool_call,
    wait_for,
)
from workers import dispatch


def start_server(tmp_path: Path, tokenizer: Path, script: dict) -> ReferenceServerProcess:
    directory = tmp_path / uuid.uuid4().hex[:6]
    directory.mkdir()
    (directory / "script.json").write_text(json.dumps(script))
    return ReferenceServerProcess(
        ["--script", str(directory / "script.json"), "--tokenizer", str(tokenizer)],
        port=free_port(),
        log_path=directory / "server.log",
    ).start()


def test_killing_one_of_two_backends_mid_run_moves_its_jobs_to_the_survivor(client, tmp_path, tiny_tokenizer_dir):
    problem = f"Two backends ({uuid.uuid4().hex[:6]})"
    script = slow_script(problem, turns=6, delay_s=0.25)
    doomed = start_server(tmp_path, tiny_tokenizer_dir, script)
    survivor = start_server(tmp_path, tiny_tokenizer_dir, script)
    backends = [
        client.add_backend(s.url, "vllm", "pair", tokenizer=str(tiny_tokenizer_dir)) for s in (doomed, survivor)
    ]
    doomed_id, survivor_id = (b.id for b in backends)
    try:
        job_ids = client.submit(math_task(problem), n=6, sampling={"model": "pair"}).job_ids
        live = lambda: {b.id: b.live_assignments for b in client.backends() if b.model == "pair"}  # noqa: E731
        wait_for(lambda: live()[doomed_id] > 0 and live()[survivor_id] > 0, what="both backends busy")
        doomed.stop()
        views = client.wait(job_ids, timeout_s=120)
        assert [v.status.value for v in views] == ["completed"] * 6, [v.error for v in views]
        assert all(v.reward == 1.0 and v.backend_id == survivor_id for v in views)
        moved = 0
        for view in views:
            generations = [t for t in client.trajectory(view.job_id).turns if t.kind == "generation"]
            if any(t.backend_id == doomed_id for t in generations) or any(t.moved_from for t in generations):
                moved += 1
                assert any(t.moved_from == doomed_id and t.backend_id == survivor_id for t in generations)
        assert moved > 0
        assert all(b.live_assignments == 0 for b in client.backends() if b.model == "pair")
    finally:
        doomed.stop()
        survivor.stop()
        for backend in backends:
            client.remove_backend(backend.id)


def test_no_call_starts_while_paused_and_calls_after_resume_carry_the_new_version(client, scripted_backend):
    problem = f"Weight sync ({uuid.uuid4().hex[:6]})"
    backend = scripted_backend(slow_script(problem, turns=5, delay_s=0.2), model="sync")
    (job_id,) = client.submit(math_task(problem), sampling={"model": "sync"}).job_ids
    wait_for(lambda: len(server_log(backend.url)) >= 1, what="the first call")
    paused = client.pause(wait_s=5)
    assert paused["inflight_calls"] == 0
    calls_at_pause = len(server_log(backend.url))
    time.sleep(1.5)
    assert len(server_log(backend.url)) == calls_at_pause
    assert client.get(job_id).status.value == "running"
    new_version = client.resume(paused["policy_version"] + 1)["policy_version"]

    (view,) = client.wait([job_id], timeout_s=60)
    assert view.status.value == "completed"
    versions = [t.policy_version for t in client.trajectory(job_id).turns if t.kind == "generation"]
    assert versions[:calls_at_pause] == [paused["policy_version"]] * calls_at_pause
    assert versions[calls_at_pause:] == [new_version] * (len(versions) - calls_at_pause)


def test_a_run_worker_keeps_a_call_gate_that_a_pause_closes_at_once_and_a_resume_opens_again(
    client, scripted_backend, service
):
    from rollout_service.state.backends import BackendPool

    problem = f"Call gate ({uuid.uuid4().hex[:6]})"
    backend = scripted_backend(slow_script(problem, turns=3, delay_s=0.05), model="gated")
    (job_id,) = client.submit(math_task(problem), sampling={"model": "gated"}).job_ids
    (view,) = client.wait([job_id], timeout_s=60)
    assert view.status.value == "completed" and len(server_log(backend.url)) == 3
    pool = BackendPool(service.redis())
    assert pool.open_gates() == 1  # the run worker's: its later calls need no round trip ahead of them

    started = time.monotonic()
    paused = client.pause(wait_s=5)
    waited_s = time.monotonic() - started
    try:
        assert paused["inflight_calls"] == 0 and pool.open_gates() == 0
        # released by the worker at its next renewal (every 0.5 s), not left to expire (1.0-1.5 s)
        assert waited_s < 0.9, waited_s
    finally:
        client.resume()
    wait_for(lambda: pool.open_gates() == 1, timeout_s=5, what="the gate to open again")


def test_a_pause_the_trainer_never_resumes_lifts_by_itself_and_a_bad_ttl_is_a_400(client, scripted_backend, service):
    problem = f"Abandoned sync ({uuid.uuid4().hex[:6]})"
    backend = scripted_backend(slow_script(problem, turns=3, delay_s=0.1), model="abandoned")
    paused = client.pause(ttl_s=1.5)
    assert paused["paused"] and 0 < paused["expires_in_s"] <= 1.5
    (job_id,) = client.submit(math_task(problem), sampling={"model": "abandoned"}).job_ids
    time.sleep(0.5)
    assert server_log(backend.url) == [] and httpx.get(f"{service.url}/v1/backends").json()["paused"]
    (view,) = client.wait([job_id], timeout_s=60)  # the trainer died: nobody resumes
    assert view.status.value == "completed" and not httpx.get(f"{service.url}/v1/backends").json()["paused"]
    for bad in ("0", "-1", "soon"):
        answer = httpx.post(f"{service.url}/v1/backends/pause", params={"ttl": bad})
        assert answer.status_code == 400 and "ttl" in answer.json()["error"]["message"]
    assert not httpx.get(f"{service.url}/v1/backends").json()["paused"]


def test_a_job_lagging_behind_its_max_policy_lag_stops_as_stale(client, scripted_backend):
    problem = f"Stale ({uuid.uuid4().hex[:6]})"
    backend = scripted_backend(slow_script(problem, turns=8, delay_s=0.3), model="stale")
    (job_id,) = client.submit(math_task(problem), sampling={"model": "stale"}, max_policy_lag=0).job_ids
    wait_for(lambda: len(server_log(backend.url)) >= 1, what="the first call")
    client.pause()
    client.resume()
    (view,) = client.wait([job_id], timeout_s=60)
    trajectory = client.trajectory(job_id)
    assert view.finish_reason.value == "stale" and trajectory.truncated
    assert sum(t.kind == "generation" for t in trajectory.turns) < 8


def test_metrics_export_backend_load_and_health(client, scripted_backend, service):
    backend = scripted_backend({"episodes": []}, model="metrics")
    text = httpx.get(f"{service.url}/metrics").text
    assert f'rollout_backend_live_assignments{{backend="{backend.id}",model="metrics"}} 0.0' in text
    assert f'rollout_backend_healthy{{backend="{backend.id}",model="metrics"}} 1.0' in text


def test_removing_a_backend_mid_run_moves_its_jobs_and_records_the_move(client, scripted_backend):
    problem = f"Removed ({uuid.uuid4().hex[:6]})"
    script = slow_script(problem, turns=5, delay_s=0.2)
    leaving, staying = scripted_backend(script, model="removal"), scripted_backend(script, model="removal")
    job_ids = client.submit(math_task(problem), n=4, sampling={"model": "removal"}).job_ids
    wait_for(lambda: len(server_log(leaving.url)) >= 1, what="a call on the leaving backend")
    client.remove_backend(leaving.id)
    views = client.wait(job_ids, timeout_s=60)
    assert [v.status.value for v in views] == ["completed"] * 4
    moved = [t for v in views for t in client.trajectory(v.job_id).turns if t.moved_from]
    assert moved and all(t.moved_from == leaving.id and t.backend_id == staying.id for t in moved)


def test_a_job_gets_its_first_call_with_its_run_stage_and_leaves_no_call_or_backend_held(
    client, scripted_backend, service, celery_app
):
    """Init records the model of an episode whose first step is an LLM call (its sandbox, if any,
    boots during that call); the script that begins the run stage starts that call too. Every call
    so counted is ended and every assignment released; a stage that does not begin starts none."""
    problem = f"First call early ({uuid.uuid4().hex[:6]})"
    backend = scripted_backend(
        {"episodes": [{"match": problem, "turns": [tool_call("finish", answer="\\boxed{4}")]}]}, model="early"
    )
    finishing = client.submit(math_task(problem), n=4, agent={"tools": ["finish"]}, sampling={"model": "early"})
    in_sandbox = client.submit(math_task(problem), agent={"tools": ["finish", "ipython"]}, sampling={"model": "early"})
    views = client.wait(finishing.job_ids + in_sandbox.job_ids, timeout_s=120)
    assert [v.status.value for v in views] == ["completed"] * 5, [v.error for v in views]
    redis = service.redis()
    recorded = [redis.hget(f"rollout:job:{j}", "first_call_model") for j in finishing.job_ids + in_sandbox.job_ids]
    assert recorded == [b"early"] * 5  # a harness's job has none: test_harness
    assert redis.hget("rollout:backend:calls", finishing.job_ids[0]) is None

    def assignments() -> tuple[int, int]:
        view = next(b for b in client.backends() if b.id == backend.id)
        return view.total_assignments, view.live_assignments

    total, live = assignments()
    assert live == 0
    redis.set("rollout:housekeeping:lock", "test", px=60_000)  # no reconcile meanwhile: the run worker must undo it
    try:
        time.sleep(1)  # a housekeeping round under way ends
        done = finishing.job_ids[0]  # its run message delivered again: the stage finds the job done
        celery_app(service.redis_url)
        dispatch.send_stage("run", [done])
        time.sleep(3)  # the message handled: no call started, nothing assigned
        assert assignments() == (total, 0) and redis.hlen("rollout:backend:calls") == 0
    finally:
        redis.delete("rollout:housekeeping:lock")
    assert client.get(done).status.value == "completed"


def test_a_server_refusing_a_prompt_longer_than_its_context_ends_the_episode_with_context_length(
    client, scripted_backend
):
    """A limit, not a failure: the episode keeps its turns and is graded, as with sampling.max_model_len."""
    problem = f"Context full ({uuid.uuid4().hex[:6]})"
    long_turn = "Let me think. " * 300 + tool_call("ipython", code="print(4)")
    scripted_backend(
        {"episodes": [{"match": problem, "turns": [long_turn, tool_call("finish", answer="4")]}]},
        "vllm",
        "short",
        "--max-model-len",
        "1000",
    )
    (job_id,) = client.submit(
        math_task(problem), agent={"tools": ["finish"]}, sampling={"model": "short", "max_new_tokens": 4096}
    ).job_ids
    (view,) = client.wait([job_id], timeout_s=60)
    assert view.status.value == "completed" and view.error is None
    assert view.finish_reason.value == "context_length" and view.reward == 0.0
    trajectory = client.trajectory(job_id)
    assert [t.kind for t in trajectory.turns] == ["generation", "observation"] and trajectory.truncated
    assert len(trajectory.prompt_ids) < 1000 <= len(trajectory.prompt_ids) + len(trajectory.response_ids)


def test_a_backend_restarted_mid_run_on_the_same_port_completes_its_jobs_token_exactly(
    client, tmp_path, tiny_tokenizer_dir
):
    """An engine restart (weight reload, crash, node reboot): its jobs wait for it to come back."""
    problem = f"Restarted ({uuid.uuid4().hex[:6]})"
    server = start_server(tmp_path, tiny_tokenizer_dir, slow_script(problem, turns=6, delay_s=0.3))
    backend = client.add_backend(server.url, "vllm", "restarted", tokenizer=str(tiny_tokenizer_dir))
    try:
        job_ids = client.submit(math_task(problem), n=4, sampling={"model": "restarted"}).job_ids
        wait_for(lambda: len(server_log(server.url)) >= 6, what="the episodes to be under way")
        before = server_log(server.url)
        server.stop()
        time.sleep(0.5)  # down long enough for calls to fail; the start itself takes seconds
        server.start()
        views = client.wait(job_ids, timeout_s=120)
        assert [v.status.value for v in views] == ["completed"] * 4, [v.error for v in views]
        assert all(v.reward == 1.0 and v.backend_id == backend.id for v in views)
        served = before + server_log(server.url)
        for view in views:
            trajectory = client.trajectory(view.job_id)
            generations = [t for t in trajectory.turns if t.kind == "generation"]
            assert len(generations) == 6 and not any(t.moved_from for t in generations)
            for turn in generations:  # each turn is what one of the two server processes returned
                context = trajectory.prompt_ids + trajectory.response_ids[: turn.start]
                assert any(
                    call["prompt_ids"] == context
                    and call["output_ids"] == trajectory.response_ids[turn.start : turn.end]
                    and call["logprobs"] == trajectory.logprobs[turn.start : turn.end]
                    for call in served
                )
    finally:
        server.stop()
        client.remove_backend(backend.id)


def ended_within(client, job_ids: list[str], timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    views = {}
    while len(views) < len(job_ids) and time.monotonic() < deadline:
        for job_id in set(job_ids) - set(views):
            view = client.get(job_id)
            if view.status.value in ("completed", "failed", "cancelled", "timed_out"):
                views[job_id] = view
        time.sleep(0.05)
    return views


def test_a_job_cancelled_mid_generation_ends_cancelled_at_once_and_its_trajectory_agrees(
    client, service, scripted_backend
):
    problem = f"Cancel mid-call ({uuid.uuid4().hex[:6]})"
    backend = scripted_backend(
        {
            "episodes": [
                {
                    "match": problem,
                    "turns": [
                        tool_call("ipython", code="print(1)"),
                        {"text": tool_call("finish", answer="4"), "delay_s": 60},
                    ],
                }
            ]
        },
        model="cancel-one",
    )
    (job_id,) = client.submit(math_task(problem), sampling={"model": "cancel-one"}).job_ids
    wait_for(lambda: len(server_log(backend.url)) == 1, what="the first turn")
    wait_for(lambda: httpx.get(f"{backend.url}/is_paused").json()["inflight"] == 1, what="the second call")
    time.sleep(0.5)  # the second call is in flight
    cancelled_at = time.monotonic()
    client.cancel(job_id)
    views = ended_within(client, [job_id], timeout_s=10)
    assert time.monotonic() - cancelled_at < 2.5 and views[job_id].status.value == "cancelled"
    trajectory = client.trajectory(job_id)
    assert trajectory.finish_reason.value == "cancelled" and trajectory.truncated
    assert [t.kind for t in trajectory.turns] == ["generation", "observation"]  # the turns before it are kept
    assert_trajectory_is_exactly_what_the_server_returned(trajectory, server_log(backend.url)[:1])
    wait_for(
        lambda: httpx.get(f"{backend.url}/health").json()["aborted_requests"] == 1,
        timeout_s=5,
        what="the server to stop the generation its client left",
    )


def test_a_job_cancelled_during_a_tool_call_sends_no_further_llm_call(client, scripted_backend):
    problem = f"Cancel in a tool ({uuid.uuid4().hex[:6]})"
    backend = scripted_backend(
        {
            "episodes": [
                {
                    "match": problem,
                    "turns": [
                        tool_call("ipython", code="import time; time.sleep(3)"),
                        {"text": tool_call("finish", answer="4"), "delay_s": 60},
                    ],
                }
            ]
        },
        model="cancel-in-tool",
    )
    (job_id,) = client.submit(math_task(problem), sampling={"model": "cancel-in-tool"}).job_ids
    wait_for(lambda: len(server_log(backend.url)) == 1, what="the first turn")
    client.cancel(job_id)  # the tool runs for 3 s: its next call starts after the cancel
    views = ended_within(client, [job_id], timeout_s=20)
    assert views[job_id].status.value == "cancelled"
    assert [t.kind for t in client.trajectory(job_id).turns] == ["generation", "observation"]
    time.sleep(0.5)
    assert len(server_log(backend.url)) == 1 and httpx.get(f"{backend.url}/health").json()["aborted_requests"] == 0


def test_many_jobs_cancelled_together_mid_generation_all_end_cancelled(client, scripted_backend):
    problem = f"Cancel many ({uuid.uuid4().hex[:6]})"
    scripted_backend(
        {"episodes": [{"match": problem, "turns": [{"text": tool_call("finish", answer="4"), "delay_s": 60}]}]},
        model="cancel-many",
    )
    job_ids = client.submit(math_task(problem), n=12, sampling={"model": "cancel-many"}).job_ids
    wait_for(lambda: sum(client.get(j).status.value == "running" for j in job_ids) >= 4, what="jobs running")
    time.sleep(0.5)
    cancelled_at = time.monotonic()
    for job_id in job_ids:
        client.cancel(job_id)
    views = ended_within(client, job_ids, timeout_s=10)
    assert time.monotonic() - cancelled_at < 4
    assert sorted(v.status.value for v in views.values()) == ["cancelled"] * 12
    for trajectory in client.trajectories(job_ids).values():
        assert trajectory.finish_reason.value == "cancelled" and trajectory.truncated


def test_jobs_wait_a_bounded_time_for_a_backend_that_never_comes_back_and_a_cancel_ends_the_wait(
    client, tiny_tokenizer_dir
):
    """The test service waits ROLLOUT_BACKEND_OUTAGE_WAIT_S=10 (180 by default)."""
    dead = client.add_backend(f"http://127.0.0.1:{free_port()}", "vllm", "gone", tokenizer=str(tiny_tokenizer_dir))
    try:
        started = time.monotonic()
        waiting, cancelled = client.submit(
            math_task("2+2?"), n=2, sampling={"model": "gone"}, agent={"tools": ["finish"]}
        ).job_ids
        time.sleep(3)
        assert {client.get(j).status.value for j in (waiting, cancelled)} == {"running"}
        cancel_at = time.monotonic()
        client.cancel(cancelled)
        assert ended_within(client, [cancelled], timeout_s=5)[cancelled].status.value == "cancelled"
        assert time.monotonic() - cancel_at < 2
        (view,) = client.wait([waiting], timeout_s=60)
        assert time.monotonic() - started >= 10
        assert view.status.value == "failed" and view.error.code == "no_backend"
        assert "ROLLOUT_BACKEND_OUTAGE_WAIT_S" in view.error.message and dead.url in view.error.message
    finally:
        client.remove_backend(dead.id)
