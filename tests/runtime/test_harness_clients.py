"""Real agent harnesses in real bwrap sandboxes: the OpenAI SDK (Chat Completions and Responses), the
Anthropic SDK (Messages) and mini-swe-agent through its preset, imported from a harness environment
(``agent.harness.env_dir``, made by ``make harnesses``) and driving a scripted backend; every
trajectory checked token for token against what the server returned."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from rollout_service.sdk.client import RolloutClient
from tests.fixtures_service import Service, running_service
from tests.helpers import assert_trajectory_is_exactly_what_the_server_returned, server_log

REPO = Path(__file__).resolve().parents[2]
HARNESS_ENV = Path(os.environ.get("ROLLOUT_TEST_HARNESS_ENV", REPO / ".harnesses" / "mini-swe-agent"))

SHELL = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
PREAMBLE = r"""
import json, os, subprocess
def shell(command):
    return subprocess.run(command, shell=True, capture_output=True, text=True).stdout
def answer(text):
    with open(os.environ["ROLLOUT_ANSWER_FILE"], "w") as f:
        f.write(text)
task = [m for m in json.load(open(os.environ["ROLLOUT_MESSAGES_FILE"])) if m["role"] == "user"][0]["content"]
"""

CHAT = (
    PREAMBLE
    + r"""
from openai import OpenAI
client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
tools = [{"type": "function", "function": {"name": "shell", "parameters": SHELL}}]
messages = [{"role": "user", "content": task}]
while True:
    choice = client.chat.completions.create(model="policy", messages=messages, tools=tools).choices[0]
    messages.append(choice.message.model_dump(exclude_none=True))
    if choice.finish_reason != "tool_calls":
        break
    for call in choice.message.tool_calls:
        output = shell(json.loads(call.function.arguments)["command"])
        messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
answer(choice.message.content)
"""
)

RESPONSES = (
    PREAMBLE
    + r"""
from openai import OpenAI
client = OpenAI()
tools = [{"type": "function", "name": "shell", "parameters": SHELL}]
items = [{"role": "user", "content": task}]
response = client.responses.create(model="policy", instructions="Use the shell.", input=items, tools=tools)
calls = 0
while any(item.type == "function_call" for item in response.output):
    outputs = [{"type": "function_call_output", "call_id": item.call_id,
                "output": shell(json.loads(item.arguments)["command"])}
               for item in response.output if item.type == "function_call"]
    calls += 1
    if calls == 1:  # the whole conversation sent again
        items += [item.model_dump(exclude_none=True) for item in response.output] + outputs
        response = client.responses.create(model="policy", instructions="Use the shell.", input=items, tools=tools)
    else:  # continued from the stored response
        response = client.responses.create(model="policy", previous_response_id=response.id, input=outputs,
                                           tools=tools)
answer(response.output_text)
"""
)

MESSAGES = (
    PREAMBLE
    + r"""
from anthropic import Anthropic
client = Anthropic()  # ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY from the environment
tools = [{"name": "shell", "description": "run a shell command", "input_schema": SHELL}]
messages = [{"role": "user", "content": task}]
while True:
    reply = client.messages.create(model="policy", max_tokens=256, system="Use the shell.", messages=messages,
                                   tools=tools)
    messages.append({"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in reply.content]})
    if reply.stop_reason != "tool_use":
        break
    messages.append({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": block.id, "content": shell(block.input["command"])}
        for block in reply.content if block.type == "tool_use"]})
answer(reply.content[-1].text)
"""
)

SCRIPTS = {"chat": CHAT, "responses": RESPONSES, "messages": MESSAGES}


def tool_call(name: str, **arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def script(source: str) -> str:
    return f"SHELL = {json.dumps(SHELL)}\n" + source


@pytest.fixture(scope="module")
def harness_env() -> Path:
    if not (HARNESS_ENV / "bin" / "mini").exists():
        pytest.fail(
            f"no harness environment at {HARNESS_ENV}: run `make harnesses` "
            "(or set ROLLOUT_TEST_HARNESS_ENV to one made by `rollout-service harness install`)"
        )
    return HARNESS_ENV


@pytest.fixture(scope="module")
def harness_service(tmp_path_factory: pytest.TempPathFactory, harness_env: Path) -> Iterator[Service]:
    """The whole service on bwrap, allowed to bind the test harness environment."""
    with running_service(
        tmp_path_factory.mktemp("harness-service"),
        ROLLOUT_HARNESS_ROOTS=str(harness_env.parent),
        ROLLOUT_RUN_CONCURRENCY="16",
    ) as service:
        yield service


@pytest.fixture
def harness_client(harness_service: Service) -> Iterator[RolloutClient]:
    with harness_service.client() as client:
        yield client


@pytest.fixture
def backend(
    harness_client: RolloutClient, scripted_server: Callable[..., str], tiny_tokenizer_dir: Path
) -> Iterator[Callable[[dict, str], str]]:
    """``backend(script, model) -> url``: a scripted server registered as ``model``, removed after the test."""
    added: list[str] = []

    def add(script_doc: dict, model: str) -> str:
        url = scripted_server(script_doc)
        added.append(harness_client.add_backend(url, "vllm", model, tokenizer=str(tiny_tokenizer_dir)).id)
        return url

    yield add
    for backend_id in added:
        harness_client.remove_backend(backend_id)


@pytest.mark.parametrize("protocol", ["chat", "responses", "messages"])
def test_a_harness_imports_its_sdk_from_env_dir_and_round_trips_tool_calls(
    harness_client, backend, harness_env, protocol
):
    problem = f"What is 2 + 2? ({uuid.uuid4().hex[:6]})"
    url = backend(
        {
            "episodes": [
                {
                    "match": problem,
                    "turns": [
                        "Let me check.\n" + tool_call("shell", command="echo hi-from-the-sandbox"),
                        tool_call("shell", command="python -c 'print(2 + 2)'"),
                        "The answer is \\boxed{4}.",
                    ],
                }
            ]
        },
        protocol,
    )
    (job_id,) = harness_client.submit(
        {"domain": "math", "problem": problem, "answer": "4"},
        sampling={"model": protocol},
        agent={"harness": {"command": ["python", "-c", script(SCRIPTS[protocol])], "env_dir": str(harness_env)}},
    ).job_ids
    (view,) = harness_client.wait([job_id], timeout_s=120)

    assert view.status.value == "completed", view.error
    assert view.finish_reason.value == "finished" and view.reward == 1.0
    assert view.result["artifact"]["answer"] == "The answer is \\boxed{4}."
    trajectory = harness_client.trajectory(job_id)
    assert [t.kind for t in trajectory.turns] == ["generation", "observation"] * 2 + ["generation"]
    assert trajectory.segments == []  # every call extended the one before
    assert_trajectory_is_exactly_what_the_server_returned(trajectory, server_log(url))
    assert [m["content"] for m in trajectory.messages if m["role"] == "tool"] == ["hi-from-the-sandbox\n", "4\n"]
    assert trajectory.messages[0] == (
        {"role": "user", "content": problem} if protocol == "chat" else {"role": "system", "content": "Use the shell."}
    )
    first_call = next(m for m in trajectory.messages if m["role"] == "assistant")
    assert first_call["tool_calls"] == [
        {"type": "function", "function": {"name": "shell", "arguments": {"command": "echo hi-from-the-sandbox"}}}
    ]


def test_mini_swe_agent_through_its_preset_finishes_with_reward_1_and_its_retry_is_a_new_segment(
    harness_client, backend, harness_env
):
    problem = f"What is 2 + 2? ({uuid.uuid4().hex[:6]})"
    url = backend(
        {
            "episodes": [
                {
                    "match": "MUST include at least one tool call",
                    "turns": [  # after mini's format error
                        "Let me compute it.\n" + tool_call("bash", command="python3 -c 'print(2 + 2)'"),
                        tool_call("bash", command="echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && echo 4"),
                    ],
                },
                {"match": problem, "turns": ["I think the answer is 4."]},  # no tool call: a format error
            ]
        },
        "mini",
    )
    (job_id,) = harness_client.submit(
        {"domain": "math", "problem": problem, "answer": "4"},
        sampling={"model": "mini"},
        agent={"harness": {"preset": "mini-swe-agent", "env_dir": str(harness_env)}},
    ).job_ids
    (view,) = harness_client.wait([job_id], timeout_s=180)

    assert view.status.value == "completed", view.error
    assert view.finish_reason.value == "finished" and view.reward == 1.0
    assert view.result["artifact"]["answer"] == "4"  # mini's submission
    trajectory = harness_client.trajectory(job_id)
    requests = server_log(url)
    assert len(requests) == 3
    assert_trajectory_is_exactly_what_the_server_returned(trajectory, requests[:1])
    (segment,) = trajectory.segments  # mini dropped the reply without a tool call: the history was rewritten
    assert_trajectory_is_exactly_what_the_server_returned(segment, requests[1:])
    assert problem in trajectory.messages[1]["content"]  # mini's own instance template around the task
    assert "ipython" not in json.dumps(trajectory.messages)  # not the built-in agent's instructions
    assert [m["content"] for m in segment.messages if m["role"] == "tool"][0].count("4") >= 1


def test_the_messages_file_holds_the_task_without_the_built_in_agents_instructions(harness_client, backend):
    problem = f"What is 3 + 3? ({uuid.uuid4().hex[:6]})"
    backend({"episodes": [{"match": problem, "turns": ["6"]}]}, "plain")
    show = "import json, os; print(json.dumps(json.load(open(os.environ['ROLLOUT_MESSAGES_FILE']))))"
    (job_id,) = harness_client.submit(
        {"domain": "math", "problem": problem, "answer": "6"},
        sampling={"model": "plain"},
        agent={"harness": {"command": ["python", "-c", show]}},
    ).job_ids
    (view,) = harness_client.wait([job_id], timeout_s=120)
    assert view.status.value == "completed", view.error
    assert json.loads(view.result["artifact"]["answer"]) == [{"role": "user", "content": problem}]


def test_a_missing_program_is_named_once_with_where_it_was_looked_for(harness_client, harness_env, backend):
    backend({"episodes": [{"match": "x", "turns": ["x"]}]}, "missing")
    (job_id,) = harness_client.submit(
        {"domain": "math", "problem": "1 + 1?", "answer": "2"},
        sampling={"model": "missing"},
        agent={"harness": {"command": ["no-such-agent", "-c", "SCRIPT-TEXT " * 50], "env_dir": str(harness_env)}},
    ).job_ids
    (view,) = harness_client.wait([job_id], timeout_s=120)

    assert view.status.value == "failed" and view.error.code == "harness_failed"
    message = view.error.message
    assert "'no-such-agent' was not found on the sandbox's PATH" in message
    assert f"{harness_env}/bin:" in message and f"the environment {harness_env} has no bin/no-such-agent" in message
    assert message.count("no-such-agent") == 2 and "SCRIPT-TEXT" not in message


@pytest.mark.parametrize(
    "harness, problem",
    [
        ({"command": ["true"], "env_dir": "relative/env"}, "must be an absolute path"),
        ({"command": ["true"], "env_dir": "/usr"}, "is outside the directories harness environments may be read from"),
        ({"command": ["true"], "env_dir": str(HARNESS_ENV / "no-such-dir")}, "does not exist"),
        ({"preset": "no-such-agent"}, "unknown; valid: mini-swe-agent"),
    ],
)
def test_a_harness_environment_or_preset_that_cannot_be_used_is_refused_at_submission(
    harness_service, harness_env, harness, problem
):
    response = httpx.post(
        f"{harness_service.url}/v1/jobs",
        json={"task": {"domain": "math", "problem": "1 + 1?", "answer": "2"}, "agent": {"harness": harness}},
    )
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    field = "agent.harness.preset" if "preset" in harness else "agent.harness.env_dir"
    assert field in message and problem in message, message
    if "outside" in problem:
        assert "ROLLOUT_HARNESS_ROOTS" in message


DIRECTORY_AGENT = r"""#!{python}
import json, os, urllib.request
messages = json.load(open(os.environ["ROLLOUT_MESSAGES_FILE"]))
body = json.dumps({{"model": "policy", "messages": messages}}).encode()
request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", body, {{
    "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"}})
reply = json.load(urllib.request.urlopen(request, timeout=60))["choices"][0]["message"]["content"]
answer = reply.split("boxed{{")[1].split("}}")[0]
if os.environ.get("CHECK_READ_ONLY") == "1":
    try:
        open(os.path.join(os.path.dirname(__file__), "written"), "w")
        answer = "its environment is writable"
    except OSError:
        pass
with open(os.environ["ROLLOUT_ANSWER_FILE"], "w") as f:
    f.write(answer)
"""


def directory_env(root: Path) -> Path:
    """A harness environment that is a plain directory: ``bin/agent``, a stdlib script."""
    env = root / "harnesses" / f"agent-{uuid.uuid4().hex[:6]}"
    (env / "bin").mkdir(parents=True)
    agent = env / "bin" / "agent"
    agent.write_text(DIRECTORY_AGENT.format(python=sys.executable))
    agent.chmod(0o755)
    return env


def run_sixteen(
    client: RolloutClient, env: Path, url: str, problems: list[tuple[str, int]], check_read_only: str
) -> None:
    job_ids = [
        client.submit(
            {"domain": "math", "problem": text, "answer": str(total)},
            sampling={"model": "sixteen"},
            agent={"harness": {"command": ["agent"], "env_dir": str(env), "env": {"CHECK_READ_ONLY": check_read_only}}},
        ).job_ids[0]
        for text, total in problems
    ]
    views = client.wait(job_ids, timeout_s=180)
    requests = {tuple(r["prompt_ids"]): r for r in server_log(url)}
    assert len(requests) == len(problems)
    for view, (_, total) in zip(views, problems):
        assert view.status.value == "completed", view.error
        assert view.result["artifact"]["answer"] == str(total) and view.reward == 1.0
        trajectory = client.trajectory(view.job_id)
        assert_trajectory_is_exactly_what_the_server_returned(trajectory, [requests[tuple(trajectory.prompt_ids)]])


def sixteen_problems() -> tuple[dict, list[tuple[str, int]]]:
    problems = [(f"What is {n} + {n + 1}? ({uuid.uuid4().hex[:6]})", 2 * n + 1) for n in range(16)]
    episodes = [{"match": text, "turns": [f"It is \\boxed{{{total}}}."]} for text, total in problems]
    return {"episodes": episodes}, problems


def test_sixteen_concurrent_harness_jobs_on_bwrap_each_get_their_own_answer_and_reward(
    harness_service, harness_client, backend
):
    env = directory_env(harness_service.state_dir)  # under the state directory, which sandboxes never see
    script_doc, problems = sixteen_problems()
    run_sixteen(harness_client, env, backend(script_doc, "sixteen"), problems, check_read_only="1")
    assert not (env / "bin" / "written").exists()


def test_sixteen_concurrent_harness_jobs_on_local_each_get_their_own_answer_and_reward(
    tmp_path_factory, scripted_server, tiny_tokenizer_dir
):
    script_doc, problems = sixteen_problems()
    url = scripted_server(script_doc)
    state = tmp_path_factory.mktemp("local-harness-service")
    with (
        running_service(state, ROLLOUT_SANDBOX="local", ROLLOUT_RUN_CONCURRENCY="16") as service,
        service.client() as client,
    ):
        client.add_backend(url, "vllm", "sixteen", tokenizer=str(tiny_tokenizer_dir))
        run_sixteen(client, directory_env(service.state_dir), url, problems, check_read_only="0")  # no isolation


@pytest.mark.parametrize("fork_server", ["1", "0"])
def test_an_env_dir_under_the_hidden_state_directory_is_bound_read_only(tmp_path, monkeypatch, fork_server):
    from rollout_service.sandbox import SandboxSpec, create_sandbox
    from rollout_service.settings import get_settings

    outside_tmp = Path(tempfile.mkdtemp(dir="/var/tmp"))  # /tmp is the sandbox's own
    try:
        state = outside_tmp / "state"
        env = directory_env(state)
        (state / "jobs.aof").write_text("ground truth")
        outside_tmp.chmod(0o755)
        monkeypatch.setenv("ROLLOUT_STATE_DIR", str(state))
        monkeypatch.setenv("ROLLOUT_SANDBOX_FORK_SERVER", fork_server)
        get_settings.cache_clear()
        workspace = tmp_path / "workspace"
        workspace.mkdir()
        with create_sandbox("bwrap", SandboxSpec("j", str(workspace), tools=("bash",), read_only=(str(env),))) as box:
            seen = box.execute("bash", {"command": f"ls {env}/bin; ls {state}; touch {env}/bin/x"}, 30)
        assert seen["output"].splitlines()[:2] == ["agent", "harnesses"]  # the environment, not the state
        assert "Read-only file system" in seen["output"] and not (env / "bin" / "x").exists()
    finally:
        get_settings.cache_clear()
        shutil.rmtree(outside_tmp)


def test_harness_install_of_an_unknown_name_without_packages_says_what_to_give(capsys):
    from rollout_service.cli import main

    assert main(["harness", "install", "no-such-agent"]) == 2
    assert (
        "'no-such-agent' is not a preset (valid: mini-swe-agent); name the packages to install with --package"
        in capsys.readouterr().err
    )


def test_a_singularity_sandbox_binds_the_env_dir_read_only_at_its_path(tmp_path, monkeypatch):
    from rollout_service.sandbox import SandboxSpec
    from rollout_service.sandbox.singularity import singularity_argv

    binary = tmp_path / "bin" / "singularity"  # only its name is looked up
    binary.parent.mkdir()
    binary.write_text("#!/bin/sh\nexit 1\n")
    binary.chmod(0o755)
    monkeypatch.setenv("PATH", f"{binary.parent}:{os.environ['PATH']}")
    env = directory_env(tmp_path)
    argv = singularity_argv(SandboxSpec("j", str(tmp_path), read_only=(str(env),)), "/images/x.sif", str(tmp_path))
    assert argv[argv.index(f"{env}:{env}:ro") - 1] == "--bind"
    assert argv.index(f"{env}:{env}:ro") < argv.index("/images/x.sif")
