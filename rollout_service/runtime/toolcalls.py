"""Tool-call parsing of a generation's decoded text, behind a small registry of formats.

Parse the text decoded from the generated *token ids* with special tokens kept (a server's
``text`` field may have dropped ``<tool_call>``). Problems are collected as human-readable
errors addressed to the model, so the agent loop can answer a malformed call with an
observation instead of ending the episode.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollout_service.errors import UnknownName


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI/chat-template shape: ``{"type": "function", "function": {...}}``."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParseResult:
    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def as_message(self) -> dict[str, Any]:
        """The assistant message in chat form, for the human-readable ``messages`` view."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.calls:
            message["tool_calls"] = [call.to_openai() for call in self.calls]
        return message


class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParseResult: ...

    def format_call(self, call: ToolCall) -> str: ...


class HermesParser:
    """Hermes/Qwen style: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"
    _tags = re.compile(r"<tool_call>|</tool_call>")
    _example = '<tool_call>\n{"name": "<tool name>", "arguments": {<arguments>}}\n</tool_call>'

    def format_call(self, call: ToolCall) -> str:
        payload = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
        return f"{self.open_tag}\n{payload}\n{self.close_tag}"

    def parse(self, text: str) -> ParseResult:
        content_parts: list[str] = []
        calls: list[ToolCall] = []
        errors: list[str] = []
        cursor = 0
        open_at: int | None = None
        for tag in self._tags.finditer(text):
            if tag.group() == self.open_tag:
                if open_at is not None:
                    errors.append(self._unclosed(len(calls) + len(errors) + 1))
                else:
                    content_parts.append(text[cursor : tag.start()])
                open_at = tag.end()
            elif open_at is None:
                errors.append(
                    f"found {self.close_tag} without a matching {self.open_tag} before it; "
                    f"write each call as {self._example}"
                )
                content_parts.append(text[cursor : tag.start()])
                cursor = tag.end()
            else:
                number = len(calls) + len(errors) + 1
                call_or_error = self._parse_body(text[open_at : tag.start()], number)
                if isinstance(call_or_error, ToolCall):
                    calls.append(call_or_error)
                else:
                    errors.append(call_or_error)
                open_at = None
                cursor = tag.end()
        if open_at is not None:
            errors.append(self._unclosed(len(calls) + len(errors) + 1))
        else:
            content_parts.append(text[cursor:])
        return ParseResult(content="".join(content_parts).strip(), calls=calls, errors=errors)

    def _unclosed(self, number: int) -> str:
        return (
            f"tool call {number}: {self.open_tag} is never closed with {self.close_tag}; "
            f"write each call as {self._example}"
        )

    def _parse_body(self, body: str, number: int) -> ToolCall | str:
        prefix = f"tool call {number}:"
        body = body.strip()
        if not body:
            return f"{prefix} empty; put a JSON object between the tags: {self._example}"
        try:
            payload, end = json.JSONDecoder().raw_decode(body)
        except json.JSONDecodeError as exc:
            return (
                f"{prefix} invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
                f"write exactly one JSON object: {self._example}"
            )
        if body[end:].strip():
            return f"{prefix} unexpected text after the JSON object: {body[end:].strip()[:80]!r}"
        if not isinstance(payload, dict):
            return f'{prefix} expected a JSON object with "name" and "arguments", got {type(payload).__name__}'
        name = payload.get("name")
        if not isinstance(name, str) or not name.strip():
            return f'{prefix} missing "name": give the tool name as a string, e.g. {self._example}'
        arguments = payload.get("arguments", {})
        if isinstance(arguments, str):
            arguments = _json_object_or_none(arguments)
            if arguments is None:
                return f'{prefix} "arguments" of {name!r} must be a JSON object, got a string that is not one'
        if not isinstance(arguments, dict):
            return (
                f'{prefix} "arguments" of {name!r} must be a JSON object like {{"key": "value"}}, '
                f"got {type(arguments).__name__}"
            )
        return ToolCall(name=name.strip(), arguments=arguments)


def _json_object_or_none(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


PARSERS: dict[str, type] = {"hermes": HermesParser}


def get_parser(name: str) -> ToolCallParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise UnknownName("tool parser", name, PARSERS) from None
