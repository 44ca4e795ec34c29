"""Hermes/Qwen tool-call parsing of decoded generations, malformed calls included."""

from __future__ import annotations

import json

import pytest

from rollout_service.errors import UnknownName
from rollout_service.runtime.tokens import ChatRenderer, load_tokenizer
from rollout_service.runtime.toolcalls import PARSERS, HermesParser, ToolCall, get_parser


def call_text(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


@pytest.fixture
def parser() -> HermesParser:
    return get_parser("hermes")


def test_a_well_formed_call_is_parsed_and_the_text_around_it_is_the_content(parser):
    result = parser.parse("Let me compute.\n" + call_text('{"name": "ipython", "arguments": {"code": "print(1)"}}'))
    assert result.calls == [ToolCall("ipython", {"code": "print(1)"})]
    assert result.content == "Let me compute."
    assert result.errors == []


def test_several_calls_are_parsed_in_order(parser):
    text = (
        call_text('{"name": "bash", "arguments": {"command": "ls"}}')
        + "\nthen\n"
        + call_text('{"name": "finish", "arguments": {"answer": "4"}}')
    )
    result = parser.parse(text)
    assert [c.name for c in result.calls] == ["bash", "finish"]
    assert result.content == "then"


def test_text_without_tags_is_all_content_and_no_calls(parser):
    result = parser.parse("The answer is \\boxed{4}.")
    assert result.calls == [] and result.errors == [] and result.content == "The answer is \\boxed{4}."


def test_invalid_json_is_reported_with_its_position_and_good_calls_still_parse(parser):
    text = call_text('{"name": "bash", "arguments": {"command": "ls"}') + call_text(
        '{"name": "finish", "arguments": {}}'
    )
    result = parser.parse(text)
    assert [c.name for c in result.calls] == ["finish"]
    assert len(result.errors) == 1
    assert "tool call 1: invalid JSON" in result.errors[0] and "line 1 column" in result.errors[0]


def test_a_call_without_a_name_is_an_error_that_shows_the_expected_format(parser):
    result = parser.parse(call_text('{"arguments": {"command": "ls"}}'))
    assert result.calls == []
    assert 'missing "name"' in result.errors[0] and '"arguments": {<arguments>}' in result.errors[0]


def test_arguments_that_are_not_an_object_are_an_error(parser):
    result = parser.parse(call_text('{"name": "bash", "arguments": ["ls"]}'))
    assert result.calls == []
    assert "\"arguments\" of 'bash' must be a JSON object" in result.errors[0]


def test_arguments_given_as_a_json_string_of_an_object_are_accepted(parser):
    result = parser.parse(call_text(json.dumps({"name": "bash", "arguments": json.dumps({"command": "ls"})})))
    assert result.calls == [ToolCall("bash", {"command": "ls"})] and result.errors == []


def test_missing_arguments_mean_no_arguments(parser):
    assert parser.parse(call_text('{"name": "finish"}')).calls == [ToolCall("finish", {})]


def test_a_payload_that_is_not_an_object_is_an_error(parser):
    assert "expected a JSON object" in parser.parse(call_text('["bash"]')).errors[0]


def test_text_after_the_json_object_is_an_error(parser):
    result = parser.parse(call_text('{"name": "finish", "arguments": {}} and more'))
    assert result.calls == [] and "unexpected text after the JSON object" in result.errors[0]


def test_an_unclosed_tag_is_an_error_and_its_body_is_not_content(parser):
    result = parser.parse('Trying.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}')
    assert result.calls == []
    assert "never closed" in result.errors[0]
    assert result.content == "Trying."


def test_a_second_open_tag_before_the_close_leaves_the_first_one_unclosed(parser):
    result = parser.parse('<tool_call>\n{"name": "a"\n' + call_text('{"name": "b", "arguments": {}}'))
    assert [c.name for c in result.calls] == ["b"]
    assert "never closed" in result.errors[0]


def test_a_stray_closing_tag_is_an_error(parser):
    result = parser.parse("done </tool_call>")
    assert result.calls == [] and "without a matching <tool_call>" in result.errors[0]
    assert result.content == "done"


def test_an_empty_call_is_an_error(parser):
    assert "empty" in parser.parse("<tool_call>\n\n</tool_call>").errors[0]


def test_format_call_is_what_the_chat_template_renders_and_parses_back(parser, tiny_tokenizer_dir):
    renderer = ChatRenderer(load_tokenizer(str(tiny_tokenizer_dir)))
    call = ToolCall("editor", {"command": "view", "path": "/w/a.py", "note": "naïve"})
    message = {"role": "assistant", "content": "", "tool_calls": [call.to_openai()]}
    rendered = renderer.render_text([{"role": "user", "content": "hi"}, message])
    assert "<|im_start|>assistant\n" + parser.format_call(call) + "<|im_end|>" in rendered
    assert parser.parse(parser.format_call(call)).calls == [call]


def test_a_parse_result_becomes_an_assistant_message_with_tool_calls(parser):
    result = parser.parse("Hm.\n" + call_text('{"name": "finish", "arguments": {"answer": "4"}}'))
    assert result.as_message() == {
        "role": "assistant",
        "content": "Hm.",
        "tool_calls": [{"type": "function", "function": {"name": "finish", "arguments": {"answer": "4"}}}],
    }


def test_an_unknown_parser_name_lists_the_known_ones():
    with pytest.raises(UnknownName, match="unknown tool parser 'qwen9'; valid: hermes"):
        get_parser("qwen9")
    assert set(PARSERS) == {"hermes"}
