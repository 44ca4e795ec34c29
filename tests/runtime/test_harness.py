"""An external agent harness (plain stdlib Python, speaking OpenAI chat.completions) runs inside
a real bwrap sandbox with no network against the job's own endpoint; the service records every
call in token space, exactly as the scripted vLLM-protocol server returned it."""

from __future__ import annotations

import concurrent.futures
import json
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from rollout_service.runtime.agent import Limits
from rollout_service.runtime.harness import ChatSession, new_api_key, run_harness
from rollout_service.sandbox import SandboxSpec, create_sandbox
from rollout_service.schemas import ChatCompletionRequest, HarnessConfig
from rollout_service.settings import get_settings
from tests.helpers import TOOL_LOOP_HARNESS, assert_trajectory_is_exactly_what_the_server_returned, server_log

BAD_REQUESTS_HARNESS = r"""
import json, os, urllib.error, urllib.request

def status(body, key=os.environ["OPENAI_API_KEY"]):
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", json.dumps(body).encode(),
                                     {"Authorization": "Bearer " + key, "Content-Type": "application/json"})
    try:
        urllib.request.urlopen(request, timeout=30)
        return [200, ""]
    except urllib.error.HTTPError as error:
        return [error.code, json.load(error)["error"]["message"]]

hello = [{"role": "user", "content": "hello"}]
print(json.dumps({"n": status({"messages": hello, "n": 2}), "no_messages": status({"model": "m"}),
                  "wrong_key": status({"messages": hello}, key="not-the-key")}))
"""


def tool_call(name: str, **arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def assert_segment_is_exactly_what_the_server_returned(segment, requests: list[dict]) -> None:
    assert_trajectory_is_exactly_what_the_server_returned(segment, requests)
    assert all(t.backend_id and t.policy_version is not None for t in segment.turns if t.kind == "generation")


def test_a_stdlib_harness_runs_three_turns_with_tool_calls_and_every_call_is_recorded_exactly(
    client, scripted_backend, scripted_server, service
):
    problem = f"What is 2 + 2? ({uuid.uuid4().hex[:6]})"
    backend = scripted_backend(
        {
            "episodes": [
                {"match": "REWRITE-MARKER", "turns": ["Summary: 4"]},
                {
                    "match": problem,
                    "turns": [
                        "Let me check.\n" + tool_call("shell", command="echo hi-from-the-sandbox"),
                        tool_call("shell", command="python -c 'print(2 + 2)'"),
                        "The answer is \\boxed{4}.",
                    ],
                },
            ]
        }
    )
    (job_id,) = client.submit(
        {"domain": "math", "problem": problem, "answer": "4"},
        agent={"harness": {"command": ["python", "-c", TOOL_LOOP_HARNESS]}},
    ).job_ids
    (view,) = client.wait([job_id], timeout_s=120)

    assert view.status.value == "completed", view.error
    assert view.finish_reason.value == "finished" and view.reward == 1.0
    assert service.redis().hget(f"rollout:job:{job_id}", "first_call_model") is None  # the harness calls first
    trajectory = client.trajectory(job_id)
    requests = server_log(backend.url)
    assert [t.kind for t in trajectory.turns] == ["generation", "observation"] * 2 + ["generation"]
    assert_segment_is_exactly_what_the_server_returned(trajectory, requests[:3])
    assert len(trajectory.segments) == 1  # the summary call rewrote the history: a new segment
    assert_segment_is_exactly_what_the_server_returned(trajectory.segments[0], requests[3:])
    tool_messages = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
    assert tool_messages == ["hi-from-the-sandbox\n", "4\n"]
    assistant = [m for m in trajectory.messages if m["role"] == "assistant"]
    assert assistant[0]["tool_calls"][0]["function"] == {
        "name": "shell",
        "arguments": {"command": "echo hi-from-the-sandbox"},
    }


def test_bad_chat_requests_get_4xx_answers_that_name_the_problem(client, scripted_backend):
    scripted_backend({"episodes": [{"match": "hello", "turns": ["hi"]}]})
    (job_id,) = client.submit(
        {"domain": "math", "problem": "1 + 1?", "answer": "2"},
        agent={"harness": {"command": ["python", "-c", BAD_REQUESTS_HARNESS]}},
    ).job_ids
    (view,) = client.wait([job_id], timeout_s=120)

    assert view.status.value == "completed", view.error
    seen = json.loads(view.result["artifact"]["answer"])  # the harness's last stdout line
    assert seen["n"][0] == 400 and "n: " in seen["n"][1]
    assert seen["no_messages"][0] == 400 and "messages" in seen["no_messages"][1]
    assert seen["wrong_key"][0] == 401 and "API key" in seen["wrong_key"][1]
    assert client.trajectory(job_id).turns == []


def test_cancelling_a_job_stops_its_harness(client, scripted_backend):
    scripted_backend({"episodes": [{"match": "hello", "turns": ["hi"]}]})
    (job_id,) = client.submit(
        {"domain": "math", "problem": "1 + 1?", "answer": "2"}, agent={"harness": {"command": ["sleep", "600"]}}
    ).job_ids
    deadline = time.time() + 60
    while client.get(job_id).status.value != "running" and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # the harness is up inside the sandbox
    client.cancel(job_id)
    began = time.monotonic()
    (view,) = client.wait([job_id], timeout_s=60)

    assert view.status.value == "cancelled"
    assert time.monotonic() - began < 15


@pytest.mark.parametrize(
    "harness, problem",
    [
        ({"command": []}, "command"),
        ({"command": [""]}, "command[0]"),
        ({"command": "python agent.py"}, "command"),
        ({"env": {}}, "command"),
    ],
)
def test_a_harness_without_a_usable_command_is_refused_at_submission(service, harness, problem):
    response = httpx.post(
        f"{service.url}/v1/jobs",
        json={"task": {"domain": "math", "problem": "1 + 1?", "answer": "2"}, "agent": {"harness": harness}},
    )
    assert response.status_code == 400
    assert f"agent.harness.{problem.split('[')[0]}" in response.json()["error"]["message"]


def test_the_chat_request_model_takes_one_choice_per_call():
    with pytest.raises(ValueError, match="less than or equal to 1"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "n": 2})
    assert HarnessConfig(command=["python", "a.py"]).env == {}


def test_a_harness_past_max_turns_is_told_the_rollout_is_over_and_the_episode_is_truncated(client, scripted_backend):
    problem = f"What is 2 + 2? ({uuid.uuid4().hex[:6]})"
    scripted_backend(
        {
            "episodes": [
                {
                    "match": problem,
                    "turns": [tool_call("shell", command="echo one"), tool_call("shell", command="echo two"), "done"],
                }
            ]
        }
    )
    (job_id,) = client.submit(
        {"domain": "math", "problem": problem, "answer": "4"},
        agent={"max_turns": 2, "harness": {"command": ["python", "-c", TOOL_LOOP_HARNESS]}},
    ).job_ids
    (view,) = client.wait([job_id], timeout_s=120)

    assert view.status.value == "completed", view.error
    assert view.finish_reason.value == "max_turns"
    trajectory = client.trajectory(job_id)
    assert trajectory.truncated and [t.kind for t in trajectory.turns].count("generation") == 2


def test_the_harness_endpoint_works_the_same_in_a_local_sandbox(tmp_path, scripted_server, tiny_tokenizer_dir):
    from tests.fixtures_service import running_service

    problem = f"What is 2 + 2? ({uuid.uuid4().hex[:6]})"
    cut_short = f"What is 2 + 2? ({uuid.uuid4().hex[:6]})"  # the same answer; killed before writing it
    url = scripted_server(
        {
            "episodes": [
                {"match": "REWRITE-MARKER", "turns": ["Summary: 4"]},
                {"match": problem, "turns": [tool_call("shell", command="echo hi"), "The answer is \\boxed{4}."]},
                {
                    "match": cut_short,
                    "turns": [tool_call("shell", command="echo one"), tool_call("shell", command="echo two"), "done"],
                },
            ]
        }
    )
    with running_service(tmp_path, ROLLOUT_SANDBOX="local") as service, service.client() as local_client:
        local_client.add_backend(url, "vllm", "scripted", tokenizer=str(tiny_tokenizer_dir))
        (job_id,) = local_client.submit(
            {"domain": "math", "problem": problem, "answer": "4"},
            agent={"harness": {"command": ["python", "-c", TOOL_LOOP_HARNESS]}},
        ).job_ids
        (view,) = local_client.wait([job_id], timeout_s=120)
        assert view.status.value == "completed", view.error
        assert view.reward == 1.0
        assert_segment_is_exactly_what_the_server_returned(local_client.trajectory(job_id), server_log(url)[:2])

        (job_id,) = local_client.submit(
            {"domain": "math", "problem": cut_short, "answer": "4"},
            agent={"max_turns": 2, "harness": {"command": ["python", "-c", TOOL_LOOP_HARNESS]}},
        ).job_ids
        (view,) = local_client.wait([job_id], timeout_s=120)
        assert view.status.value == "completed", view.error
        assert view.finish_reason.value == "max_turns" and view.reward == 0.0
        assert view.result["artifact"]["answer"] is None  # not the answer the job before wrote


ANSWER_WRITER = r"""
import os, sys, time
time.sleep(float(sys.argv[1]))
with open(os.environ["ROLLOUT_ANSWER_FILE"], "w") as f:
    f.write(sys.argv[2])
with open("answer-file-path", "w") as f:
    f.write(os.environ["ROLLOUT_ANSWER_FILE"])
"""


@pytest.fixture
def local_harness(tmp_path, monkeypatch) -> Iterator[Callable[..., tuple[object, Path]]]:
    """``local_harness(job_id, *command, stop_after_s=None)``: (episode, workspace) of a harness run
    to its end in a local sandbox of its own, in a private scratch directory."""
    scratch = Path(tempfile.mkdtemp(prefix="rs-"))
    monkeypatch.setenv("ROLLOUT_SANDBOX_SCRATCH_DIR", str(scratch))
    get_settings.cache_clear()

    def run(job_id: str, *command: str, stop_after_s: float | None = None) -> tuple[object, Path]:
        workspace = tmp_path / uuid.uuid4().hex[:8]
        workspace.mkdir()
        session = ChatSession(None, None, None, Limits(4, 16, None, 30.0), new_api_key())
        began = time.monotonic()
        with create_sandbox("local", SandboxSpec(job_id, str(workspace), tools=("bash",))) as sandbox:
            episode = run_harness(
                sandbox,
                session,
                HarnessConfig(command=list(command)),
                [],
                time.time() + 60,
                lambda: stop_after_s is not None and time.monotonic() - began > stop_after_s,
            )
        return episode, workspace

    yield run
    get_settings.cache_clear()
    assert list(scratch.iterdir()) == []  # every sandbox's directory, answer file included, is gone
    scratch.rmdir()


def test_concurrent_harnesses_in_local_sandboxes_each_get_their_own_answer_file(local_harness):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        runs = list(
            pool.map(lambda n: local_harness("same-job", "python", "-c", ANSWER_WRITER, "0.5", f"answer-{n}"), range(4))
        )

    assert [episode.answer for episode, _ in runs] == [f"answer-{n}" for n in range(4)]
    paths = [(workspace / "answer-file-path").read_text() for _, workspace in runs]
    assert len(set(paths)) == 4 and not any(Path(p).exists() for p in paths)  # one per attempt, removed after


def test_a_harness_that_wrote_no_answer_gets_none_not_the_one_before_it(local_harness):
    assert local_harness("first", "python", "-c", ANSWER_WRITER, "0", "\\boxed{4}")[0].answer == "\\boxed{4}"
    assert local_harness("second", "true")[0].answer is None


def test_a_harness_stopped_before_writing_its_answer_has_none(local_harness):
    local_harness("first", "python", "-c", ANSWER_WRITER, "0", "\\boxed{4}")
    episode, _ = local_harness("stopped", "bash", "-c", "echo 'thinking: 4'; sleep 30", stop_after_s=1.0)
    assert episode.trajectory.finish_reason.value == "cancelled"
    assert episode.answer is None  # neither the earlier harness's file nor this one's last stdout line
