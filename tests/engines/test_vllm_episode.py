"""Multi-turn episodes on a real vLLM: every turn of the built-in agent and of a harness records
exactly what vLLM computes for its tokens, and an engine killed mid-episode ends the job as data."""

from __future__ import annotations

import math
import os
import re
import signal
import time

import httpx
import pytest

from rollout_service.devtools.engines import VLLMServer
from rollout_service.devtools.models import SMOLLM2_LT_TOKEN_ID
from rollout_service.schemas import Segment
from tests.helpers import math_task, vllm_rescored

# greedy with "<" favoured, the 135M model opens a <tool_call> every turn
FORCED_TOOL_CALLS = {"temperature": 0.0, "logit_bias": {str(SMOLLM2_LT_TOKEN_ID): 10.0}}
TOOL_CALLING_AGENT = {"tools": ["finish"], "tool_parser": "hermes"}  # an unclosed call is an error observation


def tool_calling_task(problem: str, answer: str) -> dict:
    example = '{"name": "finish", "arguments": {"answer": "42"}}'
    return {
        **math_task(problem, answer),
        "system_prompt": f"{problem}\nAlways reply with a tool call, like this:\n<tool_call>\n{example}\n</tool_call>",
    }


TWO_CALL_HARNESS = r"""
import json, os, urllib.request

def chat(messages):
    body = json.dumps({"model": "any", "messages": messages}).encode()
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", body, {
        "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(request, timeout=300))["choices"][0]["message"]

messages = [{"role": "user", "content": "Name a prime number."}]
messages.append(chat(messages))
messages.append({"role": "user", "content": "Now name a larger one."})
messages.append(chat(messages))
messages = [{"role": "user", "content": "Say hello."}]
chat(messages)
with open(os.environ["ROLLOUT_ANSWER_FILE"], "w") as f:
    f.write("done")
"""


def assert_every_generation_is_vllms_own(engine: VLLMServer, segment: Segment) -> int:
    generations = [turn for turn in segment.turns if turn.kind == "generation"]
    assert generations
    for turn in generations:
        assert all(segment.loss_mask[turn.start : turn.end])
        expected = vllm_rescored(
            engine,
            segment.prompt_ids + segment.response_ids[: turn.start],
            segment.response_ids[turn.start : turn.end],
            timeout_s=300,
        )
        recorded = segment.logprobs[turn.start : turn.end]
        assert len(recorded) == len(expected) > 0
        assert all(math.isclose(a, b, abs_tol=2e-3) for a, b in zip(recorded, expected)), (recorded, expected)
    for turn in segment.turns:
        if turn.kind == "observation":
            assert not any(segment.loss_mask[turn.start : turn.end])
    return len(generations)


@pytest.fixture
def registered(client, vllm_engine: VLLMServer, smollm2_dir):
    backend = client.add_backend(vllm_engine.url, "vllm", vllm_engine.model, tokenizer=str(smollm2_dir))
    yield backend
    client.remove_backend(backend.id)


def test_every_turn_of_a_multi_turn_agent_episode_is_vllms_own_computation(client, vllm_engine: VLLMServer, registered):
    job_ids = client.submit(
        tool_calling_task("What is 17 * 23?", "391"),
        sampling={"model": "smollm2", "max_new_tokens": 32, **FORCED_TOOL_CALLS},
        agent={"max_turns": 3, **TOOL_CALLING_AGENT},
    ).job_ids
    views = client.wait(job_ids, timeout_s=600)
    assert all(v.status.value == "completed" for v in views), [(v.status, v.error) for v in views]
    for job_id in job_ids:
        trajectory = client.trajectory(job_id)
        assert assert_every_generation_is_vllms_own(vllm_engine, trajectory) >= 2  # the first an unclosed tool call
        assert len(trajectory.response_ids) == len(trajectory.logprobs) == len(trajectory.loss_mask)


def test_every_segment_of_a_harness_episode_is_vllms_own_computation(client, vllm_engine: VLLMServer, registered):
    job_id = client.submit(
        math_task("Name a prime."),
        sampling={"model": "smollm2", "max_new_tokens": 16, "temperature": 1.0},
        agent={"harness": {"command": ["python", "-c", TWO_CALL_HARNESS]}},
    ).job_ids[0]
    view = client.wait([job_id], timeout_s=600)[0]
    assert view.status.value == "completed", (view.status, view.error)
    trajectory = client.trajectory(job_id)
    assert len(trajectory.segments) == 1  # the third call started a new conversation
    assert assert_every_generation_is_vllms_own(vllm_engine, trajectory) == 2
    assert assert_every_generation_is_vllms_own(vllm_engine, trajectory.segments[0]) == 1


def _finished_requests(engine: VLLMServer) -> float:
    text = httpx.get(f"{engine.url}/metrics", timeout=10).text
    return sum(float(value) for value in re.findall(r"^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))


ENDLESS_HARNESS = r"""
import json, os, urllib.request

messages = [{"role": "user", "content": "Count to one hundred."}]
while True:
    body = json.dumps({"model": "any", "messages": messages}).encode()
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", body, {
        "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
    messages.append(json.load(urllib.request.urlopen(request, timeout=300))["choices"][0]["message"])
    messages.append({"role": "user", "content": "Go on."})
"""


@pytest.mark.kills_the_engine
def test_an_engine_killed_mid_episode_ends_the_job_failed_with_its_partial_trajectory(
    service, client, vllm_engine: VLLMServer, registered
):
    before = _finished_requests(vllm_engine)
    job_id = client.submit(
        math_task("Count to one hundred."),
        sampling={"model": "smollm2", "max_new_tokens": 48, "min_tokens": 48, "ignore_eos": True, "temperature": 1.0},
        agent={"max_turns": 50, "harness": {"command": ["python", "-c", ENDLESS_HARNESS]}},
    ).job_ids[0]
    deadline = time.monotonic() + 300
    while _finished_requests(vllm_engine) < before + 2:  # two calls done: the episode is in its third turn
        assert time.monotonic() < deadline, "the episode made no progress on vLLM"
        time.sleep(0.2)
    os.killpg(vllm_engine.process.pid, signal.SIGKILL)
    vllm_engine.process.wait()
    killed_at = time.monotonic()

    view = client.wait([job_id], timeout_s=120)[0]
    assert time.monotonic() - killed_at < 60
    assert view.status.value == "failed" and view.error.code in ("no_backend", "backend_unreachable"), view
    trajectory = client.trajectory(job_id)
    generations = [turn for turn in trajectory.turns if turn.kind == "generation"]
    assert len(generations) >= 2 and all(turn.end - turn.start == 48 for turn in generations)
    assert len(trajectory.response_ids) == len(trajectory.logprobs) == len(trajectory.loss_mask)
    assert client.backends()[0].healthy is False
