"""The job endpoint's error answers, seen through the real OpenAI and Anthropic SDKs over its Unix
socket: an ended episode is a 409 the SDKs do not retry, an over-long context is the error each
SDK (and LiteLLM) recognises, and a bad request names its field."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import anthropic
import httpx
import httpx2  # the Anthropic SDK's HTTP client
import openai
import pytest

from rollout_service.agent import Limits
from rollout_service.harness import ChatSession, EndpointServer, new_api_key
from rollout_service.schemas import FinishReason
from rollout_service.tokens import renderer_for
from rollout_service.toolcalls import get_parser

TOOLS = [{"type": "function", "function": {"name": "shell", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]


class Endpoint:
    def __init__(self, session: ChatSession, path: str) -> None:
        self.session, self.path, self.requests = session, path, 0

    def http_client(self, http: Any = httpx) -> Any:
        def count(request: Any) -> None:
            self.requests += 1

        return http.Client(transport=http.HTTPTransport(uds=self.path), event_hooks={"request": [count]})

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url="http://harness/v1", api_key=self.session.api_key, max_retries=2,
                             http_client=self.http_client())

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url="http://harness", api_key=self.session.api_key, max_retries=2,
                                   http_client=self.http_client(httpx2))


@pytest.fixture
def endpoint(tmp_path: Path, tiny_tokenizer_dir: Path) -> Iterator[Endpoint]:
    """An endpoint whose session has no LLM: every call here ends before one would be made."""
    session = ChatSession(None, renderer_for(str(tiny_tokenizer_dir)), get_parser("hermes"),
                          Limits(max_turns=4, max_new_tokens=16, max_model_len=64, tool_timeout_s=30.0), new_api_key())
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
    assert error.body["message"].startswith("This model's maximum context length is 64 tokens. However, your "
                                            "messages resulted in ")  # what LiteLLM maps to ContextWindowExceededError
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


@pytest.mark.parametrize("call, field", [
    (lambda c: c.openai().responses.create(model="m", input=[{"type": "web_search_call", "id": "x"}]), "input[0].type"),
    (lambda c: c.openai().responses.create(model="m", input="hi", tools=[{"type": "web_search"}]), "tools[0].type"),
    (lambda c: c.openai().responses.create(model="m", input="hi", previous_response_id="resp_x"),
     "previous_response_id"),
    (lambda c: c.anthropic().messages.create(model="m", max_tokens=8, messages=[
        {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}]),
     "messages[0].content[0].type"),
    (lambda c: c.anthropic().messages.create(model="m", max_tokens=0, messages=[{"role": "user", "content": "x"}]),
     "max_tokens"),
])
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
