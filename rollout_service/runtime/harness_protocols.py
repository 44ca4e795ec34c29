"""The protocols a harness may speak to its job's endpoint, each translated to one call of
``ChatSession.generate`` (chat-template messages and OpenAI function schemas in, the parsed
generation out) and back: OpenAI Chat Completions, OpenAI Responses, Anthropic Messages.

A protocol turns the conversation it is sent into chat-template messages the same way every time,
so a call that extends the previous one (the assistant reply exactly as returned, then tool
results) is recognised by the session as an extension and appended as an observation delta.
Errors are answered in the shape each SDK expects (``error.code`` for OpenAI, ``{"type": "error"}``
for Anthropic); an over-long context is ``context_length_exceeded`` / "prompt is too long".
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

import pydantic

from rollout_service.runtime.toolcalls import ToolCall
from rollout_service.schemas import ChatCompletionRequest, MessagesRequest, ResponsesRequest


class ChatError(Exception):
    """An answer other than 200; ``limit``/``used`` are set for an over-long context."""

    def __init__(self, status: int, code: str, message: str, limit: int | None = None, used: int | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.limit, self.used = status, code, message, limit, used


@dataclass
class Generated:
    """One call's answer: the assistant message as recorded (``reply``), and its accounting."""

    reply: dict[str, Any]
    calls: list[ToolCall]
    finish: str  # "stop", "length" or "tool_calls"
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Call:
    """A request translated: chat-template messages, OpenAI function tools, the asked cap."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    max_tokens: int | None
    model: str | None
    stream: bool = False


def _text(content: Any, where: str, kinds: tuple[str, ...] = ("text", "input_text", "output_text")) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for k, part in enumerate(content):
        if not isinstance(part, dict):
            raise ChatError(400, "invalid_request", f"{where}[{k}] must be an object")
        if part.get("type", "text") not in kinds:
            raise ChatError(
                400,
                "invalid_request",
                f"{where}[{k}].type {part.get('type')!r} is not supported; send text parts ({', '.join(kinds)})",
            )
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _arguments(raw: Any, where: str) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ChatError(400, "invalid_request", f"{where} must be a JSON object (or its JSON string)")
    return value


def _function_tool(name: Any, description: Any, parameters: Any, where: str) -> dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise ChatError(400, "invalid_request", f"{where}.name must be a non-empty string")
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    function["parameters"] = parameters if isinstance(parameters, dict) else {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def _validated(model: type[pydantic.BaseModel], body: bytes) -> Any:
    from rollout_service.schemas import validation_message

    try:
        return model.model_validate_json(body or b"null")
    except pydantic.ValidationError as exc:
        raise ChatError(400, "invalid_request", validation_message(exc)) from None


def _new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


class Protocol:
    name: str = ""
    routes: tuple[str, ...] = ()
    context_param: str = "messages"

    def parse(self, body: bytes, memory: dict[str, list[dict[str, Any]]]) -> Call:
        raise NotImplementedError

    def answer(self, call: Call, generated: Generated, memory: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
        raise NotImplementedError

    def events(self, answer: dict[str, Any]) -> list[tuple[str | None, Any]]:
        """The answer as the server-sent events a streaming client expects: (event name, data)."""
        raise NotImplementedError

    def error(self, error: ChatError) -> dict[str, Any]:
        kind = "invalid_request_error" if error.status < 500 else "server_error"
        message = error.message
        if error.code == "context_length_exceeded" and error.limit is not None:
            message = (
                f"This model's maximum context length is {error.limit} tokens. However, your messages "
                f"resulted in {error.used} tokens. {error.message}"
            )
        return {
            "error": {
                "message": message,
                "type": kind,
                "param": self.context_param if error.code == "context_length_exceeded" else None,
                "code": error.code,
            }
        }


def template_message(message: Any, index: int) -> dict[str, Any]:
    """An OpenAI chat message in the shape chat templates expect (text content, argument objects)."""
    out: dict[str, Any] = {"role": message.role, "content": _text(message.content, f"messages[{index}].content")}
    if message.role == "developer":
        out["role"] = "system"
    extra = message.model_extra or {}
    if message.role == "tool" and isinstance(extra.get("name"), str):
        out["name"] = extra["name"]
    if message.tool_calls:
        calls = []
        for k, call in enumerate(message.tool_calls):
            where = f"messages[{index}].tool_calls[{k}]"
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ChatError(
                    400, "invalid_request", f'{where} needs {{"type": "function", "function": {{"name", "arguments"}}}}'
                )
            calls.append(
                ToolCall(
                    function["name"], _arguments(function.get("arguments", {}), f"{where}.function.arguments")
                ).to_openai()
            )
        out["tool_calls"] = calls
    return out


class ChatCompletions(Protocol):
    name = "chat.completions"
    routes = ("/v1/chat/completions", "/chat/completions")

    def parse(self, body: bytes, memory: dict[str, list[dict[str, Any]]]) -> Call:
        request = _validated(ChatCompletionRequest, body)
        return Call(
            [template_message(m, i) for i, m in enumerate(request.messages)],
            request.tools or None,
            request.max_completion_tokens or request.max_tokens,
            request.model,
            request.stream,
        )

    def answer(self, call: Call, generated: Generated, memory: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
        reply = generated.reply
        message: dict[str, Any] = {"role": "assistant", "content": reply["content"]}
        if generated.calls:
            message["content"] = reply["content"] or None
            message["tool_calls"] = [
                {
                    "id": _new_id("call_"),
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                }
                for c in generated.calls
            ]
        return {
            "id": _new_id("chatcmpl-"),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": call.model or "rollout",
            "choices": [{"index": 0, "message": message, "finish_reason": generated.finish, "logprobs": None}],
            "usage": {
                "prompt_tokens": generated.prompt_tokens,
                "completion_tokens": generated.completion_tokens,
                "total_tokens": generated.prompt_tokens + generated.completion_tokens,
            },
        }

    def events(self, answer: dict[str, Any]) -> list[tuple[str | None, Any]]:
        head = {key: answer[key] for key in ("id", "created", "model")}
        choice, message = answer["choices"][0], answer["choices"][0]["message"]

        def chunk(delta: dict[str, Any], finish: str | None = None, **more: Any) -> tuple[str | None, Any]:
            return None, {
                **head,
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
                **more,
            }

        chunks = [chunk({"role": "assistant", "content": message["content"] or ""})]
        if message.get("tool_calls"):
            chunks.append(chunk({"tool_calls": [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]}))
        chunks.append(chunk({}, choice["finish_reason"], usage=answer["usage"]))
        return [*chunks, (None, "[DONE]")]


class Responses(Protocol):
    """``POST /v1/responses`` with ``input`` items (messages, function_call, function_call_output),
    ``instructions`` and function tools; ``previous_response_id`` continues a response this job's
    endpoint returned (held in memory for the episode)."""

    name = "responses"
    routes = ("/v1/responses", "/responses")
    context_param = "input"

    def parse(self, body: bytes, memory: dict[str, list[dict[str, Any]]]) -> Call:
        request = _validated(ResponsesRequest, body)
        messages: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            if request.previous_response_id not in memory:
                raise ChatError(
                    400,
                    "invalid_request",
                    f"previous_response_id {request.previous_response_id!r} is not a response of this episode",
                )
            messages = [dict(m) for m in memory[request.previous_response_id]]
        if request.instructions is not None and not messages:
            messages.append({"role": "system", "content": request.instructions})
        items = [{"role": "user", "content": request.input}] if isinstance(request.input, str) else request.input
        for k, item in enumerate(items):
            self._add_item(messages, item, f"input[{k}]")
        if not messages:
            raise ChatError(400, "invalid_request", "input: give at least one message")
        tools = None
        if request.tools:
            tools = []
            for k, tool in enumerate(request.tools):
                if tool.get("type") != "function":
                    raise ChatError(
                        400,
                        "invalid_request",
                        f"tools[{k}].type {tool.get('type')!r} is not supported; only function tools",
                    )
                tools.append(
                    _function_tool(tool.get("name"), tool.get("description"), tool.get("parameters"), f"tools[{k}]")
                )
        return Call(messages, tools, request.max_output_tokens, request.model, request.stream)

    @staticmethod
    def _add_item(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ChatError(400, "invalid_request", f"{where}.role must be user, system, developer or assistant")
            messages.append(
                {
                    "role": "system" if role == "developer" else role,
                    "content": _text(item.get("content"), f"{where}.content"),
                }
            )
        elif kind == "function_call":
            call = ToolCall(item.get("name") or "", _arguments(item.get("arguments", "{}"), f"{where}.arguments"))
            if not call.name:
                raise ChatError(400, "invalid_request", f"{where}.name must be a non-empty string")
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call.to_openai())
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {"role": "tool", "content": output if isinstance(output, str) else _text(output, f"{where}.output")}
            )
        elif kind != "reasoning":
            raise ChatError(
                400,
                "invalid_request",
                f"{where}.type {kind!r} is not supported; send message, function_call or function_call_output items",
            )

    def answer(self, call: Call, generated: Generated, memory: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
        reply = generated.reply
        output: list[dict[str, Any]] = []
        if reply["content"] or not generated.calls:
            output.append(
                {
                    "type": "message",
                    "id": _new_id("msg_"),
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": reply["content"], "annotations": []}],
                }
            )
        for c in generated.calls:
            output.append(
                {
                    "type": "function_call",
                    "id": _new_id("fc_"),
                    "call_id": _new_id("call_"),
                    "name": c.name,
                    "arguments": json.dumps(c.arguments),
                    "status": "completed",
                }
            )
        response_id = _new_id("resp_")
        memory[response_id] = [*call.messages, reply]
        cut = generated.finish == "length"
        return {
            "id": response_id,
            "object": "response",
            "created_at": int(time.time()),
            "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "model": call.model or "rollout",
            "output": output,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "error": None,
            "usage": {
                "input_tokens": generated.prompt_tokens,
                "output_tokens": generated.completion_tokens,
                "total_tokens": generated.prompt_tokens + generated.completion_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            },
        }

    def events(self, answer: dict[str, Any]) -> list[tuple[str | None, Any]]:
        events: list[tuple[str | None, Any]] = []

        def event(kind: str, **data: Any) -> None:
            events.append((kind, {"type": kind, "sequence_number": len(events), **data}))

        event("response.created", response={**answer, "status": "in_progress", "output": [], "usage": None})
        for index, item in enumerate(answer["output"]):
            at = {"output_index": index, "item_id": item["id"]}
            if item["type"] == "message":
                event(
                    "response.output_item.added",
                    output_index=index,
                    item={**item, "status": "in_progress", "content": []},
                )
                part = item["content"][0]
                event("response.content_part.added", **at, content_index=0, part={**part, "text": ""})
                event("response.output_text.delta", **at, content_index=0, delta=part["text"], logprobs=[])
                event("response.output_text.done", **at, content_index=0, text=part["text"], logprobs=[])
                event("response.content_part.done", **at, content_index=0, part=part)
            else:
                event(
                    "response.output_item.added",
                    output_index=index,
                    item={**item, "status": "in_progress", "arguments": ""},
                )
                event("response.function_call_arguments.delta", **at, delta=item["arguments"])
                event("response.function_call_arguments.done", **at, arguments=item["arguments"])
            event("response.output_item.done", output_index=index, item=item)
        event("response.incomplete" if answer["status"] == "incomplete" else "response.completed", response=answer)
        return events


class AnthropicMessages(Protocol):
    """``POST /v1/messages``: ``system``, text / tool_use / tool_result blocks, tools with ``input_schema``."""

    name = "messages"
    routes = ("/v1/messages", "/messages")

    def parse(self, body: bytes, memory: dict[str, list[dict[str, Any]]]) -> Call:
        request = _validated(MessagesRequest, body)
        messages: list[dict[str, Any]] = []
        if request.system:
            messages.append({"role": "system", "content": _text(request.system, "system", ("text",))})
        names: dict[str, str] = {}
        for i, message in enumerate(request.messages):
            where = f"messages[{i}].content"
            if message.role == "system":  # as a system prompt where it stands
                messages.append({"role": "system", "content": _text(message.content, where, ("text",))})
                continue
            blocks = message.content
            if isinstance(blocks, str):
                blocks = [{"type": "text", "text": blocks}]
            texts, calls, results = [], [], []
            for k, block in enumerate(blocks):
                kind = block.get("type") if isinstance(block, dict) else None
                if kind == "text":
                    texts.append(str(block.get("text", "")))
                elif kind == "tool_use" and message.role == "assistant":
                    arguments = _arguments(block.get("input", {}), f"{where}[{k}].input")
                    call = ToolCall(str(block.get("name") or ""), arguments)
                    names[str(block.get("id"))] = call.name
                    calls.append(call.to_openai())
                elif kind == "tool_result" and message.role == "user":
                    text = _text(block.get("content"), f"{where}[{k}].content", ("text",))
                    result = {"role": "tool", "content": text}
                    if str(block.get("tool_use_id")) in names:
                        result["name"] = names[str(block.get("tool_use_id"))]
                    results.append(result)
                elif kind not in ("thinking", "redacted_thinking"):
                    raise ChatError(
                        400,
                        "invalid_request",
                        f"{where}[{k}].type {kind!r} is not supported in a {message.role} message",
                    )
            messages.extend(results)
            if message.role == "assistant":
                reply: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
                if calls:
                    reply["tool_calls"] = calls
                messages.append(reply)
            elif texts or not results:
                messages.append({"role": "user", "content": "".join(texts)})
        tools = None
        if request.tools:
            tools = [
                _function_tool(t.get("name"), t.get("description"), t.get("input_schema"), f"tools[{k}]")
                for k, t in enumerate(request.tools)
            ]
        return Call(messages, tools, request.max_tokens, request.model, request.stream)

    def answer(self, call: Call, generated: Generated, memory: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if generated.reply["content"]:
            content.append({"type": "text", "text": generated.reply["content"]})
        for c in generated.calls:
            content.append({"type": "tool_use", "id": _new_id("toolu_"), "name": c.name, "input": c.arguments})
        stop = {"tool_calls": "tool_use", "length": "max_tokens"}.get(generated.finish, "end_turn")
        return {
            "id": _new_id("msg_"),
            "type": "message",
            "role": "assistant",
            "model": call.model or "rollout",
            "content": content,
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": {"input_tokens": generated.prompt_tokens, "output_tokens": generated.completion_tokens},
        }

    def events(self, answer: dict[str, Any]) -> list[tuple[str | None, Any]]:
        events: list[tuple[str | None, Any]] = []

        def event(kind: str, **data: Any) -> None:
            events.append((kind, {"type": kind, **data}))

        event(
            "message_start",
            message={**answer, "content": [], "stop_reason": None, "usage": {**answer["usage"], "output_tokens": 0}},
        )
        for index, block in enumerate(answer["content"]):
            if block["type"] == "text":
                event("content_block_start", index=index, content_block={"type": "text", "text": ""})
                event("content_block_delta", index=index, delta={"type": "text_delta", "text": block["text"]})
            else:
                event("content_block_start", index=index, content_block={**block, "input": {}})
                event(
                    "content_block_delta",
                    index=index,
                    delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])},
                )
            event("content_block_stop", index=index)
        event(
            "message_delta",
            delta={"stop_reason": answer["stop_reason"], "stop_sequence": None},
            usage={"output_tokens": answer["usage"]["output_tokens"]},
        )
        event("message_stop")
        return events

    def error(self, error: ChatError) -> dict[str, Any]:
        kinds = {
            400: "invalid_request_error",
            401: "authentication_error",
            404: "not_found_error",
            409: "invalid_request_error",
        }
        message = error.message
        if error.code == "context_length_exceeded":
            message = (
                f"prompt is too long: {error.used} tokens > {error.limit} maximum"
                if error.limit is not None
                else f"prompt is too long: {error.message}"
            )
        return {
            "type": "error",
            "error": {"type": kinds.get(error.status, "api_error"), "message": message, "code": error.code},
        }


PROTOCOLS: dict[str, Protocol] = {p.name: p for p in (ChatCompletions(), Responses(), AnthropicMessages())}
ROUTES: dict[str, Protocol] = {route: p for p in PROTOCOLS.values() for route in p.routes}


def server_sent(events: list[tuple[str | None, Any]]) -> bytes:
    lines = []
    for name, data in events:
        payload = data if isinstance(data, str) else json.dumps(data)
        lines.append((f"event: {name}\n" if name else "") + f"data: {payload}\n\n")
    return "".join(lines).encode()


def protocol_for(path: str) -> Protocol | None:
    return ROUTES.get(path.split("?", 1)[0].rstrip("/"))


def all_routes() -> str:
    return ", ".join(f"POST {p.routes[0]}" for p in PROTOCOLS.values())
