"""The job endpoint seen through the real OpenAI and Anthropic SDKs over its Unix socket: streamed
answers round-trip tool calls token-exactly against a scripted server, an ended episode is a 409 the
SDKs do not retry, an over-long context is the error each SDK (and LiteLLM) recognises, and a bad
request names its field."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2  # the Anthropic SDK's HTTP client
import openai
import pytest

from rollout_service.runtime.agent import Limits
from rollout_service.runtime.harness import ChatSession, EndpointServer, new_api_key
from rollout_service.runtime.inference import make_client
from rollout_service.runtime.tokens import renderer_for
from rollout_service.runtime.toolcalls import get_parser
from rollout_service.runtime.trajectory import TrajectoryBuilder
from rollout_service.schemas import FinishReason, Sampling
from tests.helpers import assert_trajectory_is_exactly_what_the_server_returned, server_log

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "shell",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        },
    }
]


class Endpoint:
    def __init__(self, session: ChatSession, path: str) -> None:
        self.session, self.path, self.requests = session, path, 0

    def http_client(self, http: Any = httpx) -> Any:
        def count(request: Any) -> None:
            self.requests += 1

        return http.Client(transport=http.HTTPTransport(uds=self.path), event_hooks={"request": [count]})

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url="http://harness/v1", api_key=self.session.api_key, max_retries=2, http_client=self.http_client()
        )

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(
            base_url="http://harness", api_key=self.session.api_key, max_retries=2, http_client=self.http_client(httpx2)
        )


@pytest.fixture
def endpoint(tmp_path: Path, tiny_tokenizer_dir: Path) -> Iterator[Endpoint]:
    """An endpoint whose session has no LLM: every call here ends before one would be made."""
    session = ChatSession(
        None,
        renderer_for(str(tiny_tokenizer_dir)),
        get_parser("hermes"),
        Limits(max_turns=4, max_new_tokens=16, max_model_len=64, tool_timeout_s=30.0),
        new_api_key(),
    )
    path = os.path.join(tmp_path, "endpoint.sock")
    server = EndpointServer(path, session)
    yield Endpoint(session, path)
    server.close()


LONG = "word " * 200


def test_an_ended_episode_is_a_409_the_openai_sdk_does_not_retry(endpoint):
    endpoint.session.stopped = FinishReason.max_turns
    with pytest.raises(openai.ConflictError) as raised:
        endpoint.openai().chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert raised.value.response.headers["x-should-retry"] == "false"
    assert raised.value.code == "episode_over" and "finish_reason=max_turns" in raised.value.message
    with pytest.raises(openai.ConflictError):
        endpoint.openai().responses.create(model="m", input="hi")
    assert endpoint.requests == 2  # one each: no retries


def test_an_ended_episode_is_a_409_the_anthropic_sdk_does_not_retry(endpoint):
    endpoint.session.stopped = FinishReason.deadline
    with pytest.raises(anthropic.ConflictError) as raised:
        endpoint.anthropic().messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert raised.value.response.headers["x-should-retry"] == "false"
    assert raised.value.body["error"]["message"].startswith("this rollout is over (finish_reason=deadline)")
    assert endpoint.requests == 1


def test_an_over_long_context_is_context_length_exceeded_for_openai_clients(endpoint):
    with pytest.raises(openai.BadRequestError) as raised:
        endpoint.openai().chat.completions.create(model="m", messages=[{"role": "user", "content": LONG}], tools=TOOLS)
    error = raised.value
    assert error.code == "context_length_exceeded" and error.param == "messages"
    assert error.body["type"] == "invalid_request_error"
    assert error.body["message"].startswith(
        "This model's maximum context length is 64 tokens. However, your messages resulted in "
    )  # what LiteLLM maps to ContextWindowExceededError
    assert endpoint.session.stopped == FinishReason.context_length


def test_an_over_long_context_is_prompt_too_long_for_responses_and_anthropic_clients(endpoint, tiny_tokenizer_dir):
    with pytest.raises(openai.BadRequestError) as raised:
        endpoint.openai().responses.create(model="m", input=LONG)
    assert raised.value.code == "context_length_exceeded" and raised.value.param == "input"
    endpoint.session.stopped = None
    with pytest.raises(anthropic.BadRequestError) as too_long:
        endpoint.anthropic().messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": LONG}])
    error = too_long.value.body["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("prompt is too long: ") and error["message"].endswith(" > 64 maximum")
    assert endpoint.requests == 2


@pytest.mark.parametrize(
    "call, field",
    [
        (
            lambda c: c.openai().responses.create(model="m", input=[{"type": "web_search_call", "id": "x"}]),
            "input[0].type",
        ),
        (lambda c: c.openai().responses.create(model="m", input="hi", tools=[{"type": "web_search"}]), "tools[0].type"),
        (
            lambda c: c.openai().responses.create(model="m", input="hi", previous_response_id="resp_x"),
            "previous_response_id",
        ),
        (
            lambda c: c.anthropic().messages.create(
                model="m",
                max_tokens=8,
                messages=[
                    {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}
                ],
            ),
            "messages[0].content[0].type",
        ),
        (
            lambda c: c.anthropic().messages.create(
                model="m", max_tokens=0, messages=[{"role": "user", "content": "x"}]
            ),
            "max_tokens",
        ),
    ],
)
def test_a_bad_request_is_a_400_naming_the_field(endpoint, call, field):
    with pytest.raises((openai.BadRequestError, anthropic.BadRequestError)) as raised:
        call(endpoint)
    body = raised.value.body
    message = (body.get("error") or {}).get("message") or body.get("message")
    assert field in message, message
    assert endpoint.session.stopped is None


def test_a_wrong_key_is_a_401_for_both_sdks(endpoint):
    chat, messages = endpoint.openai(), endpoint.anthropic()
    endpoint.session.api_key = new_api_key()
    with pytest.raises(openai.AuthenticationError):
        chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.AuthenticationError) as raised:
        messages.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert raised.value.body["error"]["type"] == "authentication_error"
    assert endpoint.requests == 2


class ScriptedLLM:
    """The job's LLM reduced to one scripted server: each call generated there and recorded."""

    def __init__(self, url: str) -> None:
        self.client = make_client("vllm", url, "scripted")

    def generate(self, prompt_ids: list[int], max_new_tokens: int, record: TrajectoryBuilder) -> list[int]:
        generation = self.client.generate(prompt_ids, Sampling(), max_new_tokens, 60.0)
        record.add_generation(
            generation.token_ids,
            generation.logprobs,
            backend_id="scripted",
            policy_version=0,
            finish_reason=generation.finish_reason,
            latency_s=generation.latency_s,
        )
        return generation.token_ids


def tool_call(name: str, **arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@pytest.fixture
def scripted_endpoint(endpoint, scripted_server) -> Callable[[str], str]:
    """``scripted_endpoint(problem) -> url``: the endpoint's session generating from a scripted server."""

    def start(problem: str) -> str:
        url = scripted_server(
            {
                "episodes": [
                    {"match": problem, "turns": ["Let me check.\n" + tool_call("shell", command="echo hi"), "It is 4."]}
                ]
            }
        )
        endpoint.session.llm = ScriptedLLM(url)
        endpoint.session.limits.max_model_len, endpoint.session.limits.max_new_tokens = None, 256
        return url

    return start


def assert_recorded_exactly(session: ChatSession, url: str) -> None:
    trajectory = session.build(FinishReason.finished)
    assert trajectory.segments == [] and [t.kind for t in trajectory.turns] == [
        "generation",
        "observation",
        "generation",
    ]
    assert_trajectory_is_exactly_what_the_server_returned(trajectory, server_log(url))
    assert trajectory.messages[-3]["tool_calls"] == [
        {"type": "function", "function": {"name": "shell", "arguments": {"command": "echo hi"}}}
    ]


def test_streamed_chat_completions_round_trip_a_tool_call(endpoint, scripted_endpoint):
    url = scripted_endpoint(problem := "Streamed chat: 2 + 2?")
    client = endpoint.openai()
    messages: list[dict] = [{"role": "user", "content": problem}]
    chunks = list(client.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=True))
    call = chunks[1].choices[0].delta.tool_calls[0]
    assert chunks[0].choices[0].delta.content == "Let me check." and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert (call.function.name, json.loads(call.function.arguments)) == ("shell", {"command": "echo hi"})
    messages += [
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": "shell", "arguments": call.function.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "hi\n"},
    ]
    final = list(client.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in final) == "It is 4."
    assert final[-1].usage.completion_tokens > 0
    assert_recorded_exactly(endpoint.session, url)


def test_streamed_responses_round_trip_a_tool_call(endpoint, scripted_endpoint):
    url = scripted_endpoint(problem := "Streamed responses: 2 + 2?")
    client = endpoint.openai()
    tools = [{"type": "function", "name": "shell", "parameters": TOOLS[0]["function"]["parameters"]}]
    with client.responses.stream(model="m", input=problem, tools=tools) as stream:
        kinds = [event.type for event in stream]
        first = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.function_call_arguments.done" in kinds
    call = next(item for item in first.output if item.type == "function_call")
    assert first.output_text == "Let me check." and json.loads(call.arguments) == {"command": "echo hi"}
    with client.responses.stream(
        model="m",
        previous_response_id=first.id,
        tools=tools,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "hi\n"}],
    ) as stream:
        final = stream.get_final_response()
    assert final.output_text == "It is 4." and final.status == "completed"
    assert_recorded_exactly(endpoint.session, url)


def test_streamed_anthropic_messages_round_trip_a_tool_call(endpoint, scripted_endpoint):
    url = scripted_endpoint(problem := "Streamed messages: 2 + 2?")
    client = endpoint.anthropic()
    tools = [{"name": "shell", "input_schema": TOOLS[0]["function"]["parameters"]}]
    messages: list[dict] = [{"role": "user", "content": problem}]
    with client.messages.stream(model="m", max_tokens=64, messages=messages, tools=tools) as stream:
        first = stream.get_final_message()
    text, use = first.content
    assert (text.text, use.name, use.input, first.stop_reason) == (
        "Let me check.",
        "shell",
        {"command": "echo hi"},
        "tool_use",
    )
    messages += [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "hi\n"}]},
    ]
    with client.messages.stream(model="m", max_tokens=64, messages=messages, tools=tools) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == "It is 4." and final.stop_reason == "end_turn"
    assert_recorded_exactly(endpoint.session, url)


def test_a_system_entry_inside_anthropic_messages_is_taken_as_a_system_message(endpoint, scripted_endpoint):
    """Claude Code sends one when its model name is not a Claude name; it must not cost a 400 and a retry."""
    url = scripted_endpoint(problem := "A system entry inside messages: 2 + 2?")
    client = endpoint.anthropic()
    tools = [{"name": "shell", "input_schema": TOOLS[0]["function"]["parameters"]}]
    messages: list[dict] = [
        {"role": "system", "content": [{"type": "text", "text": "You are a careful agent."}]},
        {"role": "user", "content": problem},
    ]
    first = client.messages.create(model="qwen3", max_tokens=64, messages=messages, tools=tools)  # type: ignore[arg-type]
    use = first.content[1]
    messages += [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "hi\n"}]},
    ]
    final = client.messages.create(model="qwen3", max_tokens=64, messages=messages, tools=tools)  # type: ignore[arg-type]
    assert final.content[0].text == "It is 4." and endpoint.requests == 2
    assert_recorded_exactly(endpoint.session, url)
    assert endpoint.session.build(FinishReason.finished).messages[0] == {
        "role": "system",
        "content": "You are a careful agent.",
    }
