"""The agent's tools through the full path: client -> Unix socket -> action server in bwrap -> tool."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_service.errors import UnknownName
from rollout_service.sandbox import SandboxSpec, create_sandbox
from rollout_service.sandbox.base import ServerSandbox
from rollout_service.settings import get_settings
from rollout_service.tools.output import HeadTailBuffer, cap_output, clean_terminal_text
from rollout_service.tools.schemas import TOOL_SCHEMAS, tool_schemas


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tools-workspace")


@pytest.fixture(scope="module")
def sandbox(workspace: Path) -> Iterator[ServerSandbox]:
    box = create_sandbox("bwrap", SandboxSpec("job-tools", str(workspace)))
    box.start()
    yield box
    box.stop()


def bash(sandbox: ServerSandbox, command: str, timeout_s: float = 10) -> dict:
    return sandbox.execute("bash", {"command": command}, timeout_s)


def python(sandbox: ServerSandbox, code: str, timeout_s: float = 60) -> dict:
    return sandbox.execute("ipython", {"code": code}, timeout_s)


def edit(sandbox: ServerSandbox, **args: object) -> dict:
    return sandbox.execute("editor", args, 10)


def test_working_directory_and_exports_persist_across_bash_calls(sandbox: ServerSandbox) -> None:
    assert bash(sandbox, "mkdir -p sub/dir && cd sub/dir && export GREETING=hello")["exit_code"] == 0
    assert bash(sandbox, 'pwd; echo "$GREETING"; cd /workspace')["output"] == "/workspace/sub/dir\nhello"


def test_bash_reports_exit_codes_and_strips_ansi(sandbox: ServerSandbox) -> None:
    failed = bash(sandbox, "echo out; ls /nonexistent")
    assert failed["exit_code"] == 2 and "No such file" in failed["output"] and "out" in failed["output"]
    colored = bash(sandbox, r"printf '\033[1;31mred\033[0m \033]0;title\007done\n'")
    assert colored["output"] == "red done"


def test_sleep_past_the_timeout_returns_promptly_and_the_shell_stays_usable(sandbox: ServerSandbox) -> None:
    bash(sandbox, "export KEPT=yes")
    started = time.monotonic()
    observation = bash(sandbox, "echo before; sleep 100", timeout_s=1)
    assert time.monotonic() - started < 3
    assert observation["timed_out"] is True
    assert "timed out after 1 s" in observation["output"] and "before" in observation["output"]
    assert bash(sandbox, "echo $KEPT")["output"] == "yes"


def test_a_command_ignoring_ctrl_c_is_killed_at_the_timeout(sandbox: ServerSandbox) -> None:
    started = time.monotonic()
    observation = bash(sandbox, "bash -c \"trap '' INT; sleep 100\"", timeout_s=1)
    assert time.monotonic() - started < 5
    assert observation["timed_out"] and "killed" in observation["output"]
    assert bash(sandbox, "echo usable")["output"] == "usable"


def test_a_megabyte_of_output_is_capped_keeping_head_and_tail(sandbox: ServerSandbox) -> None:
    cap = get_settings().tool_output_cap_bytes
    observation = bash(sandbox, "seq 1 200000 | head -c 1000000; echo; echo THE-END")
    assert len(observation["output"].encode()) < cap + 200
    assert observation["output"].startswith("1\n2\n3\n")
    assert observation["output"].endswith("THE-END")
    assert "bytes of output cut" in observation["output"]


def test_unclosed_quote_is_reported_without_running_anything(sandbox: ServerSandbox) -> None:
    started = time.monotonic()
    observation = bash(sandbox, "touch should-not-exist\necho 'unclosed")
    assert time.monotonic() - started < 2
    assert observation["error"] == "syntax error" and "nothing was run" in observation["output"]
    assert bash(sandbox, "ls should-not-exist")["exit_code"] != 0


def test_commands_get_no_terminal_input_so_they_do_not_hang(sandbox: ServerSandbox) -> None:
    started = time.monotonic()
    assert bash(sandbox, "cat; read x; echo done")["output"] == "done"
    assert time.monotonic() - started < 2


def test_exiting_the_shell_starts_a_fresh_one(sandbox: ServerSandbox) -> None:
    observation = bash(sandbox, "exit 3")
    assert observation["error"] == "shell exited" and "fresh shell" in observation["output"]
    assert bash(sandbox, "pwd")["output"] == "/workspace"


def test_ipython_keeps_variables_between_cells(sandbox: ServerSandbox) -> None:
    assert python(sandbox, "x = 20\ndef double(v):\n    return 2 * v")["error"] is None
    assert python(sandbox, "double(x) + 2")["output"] == "42"
    assert python(sandbox, "print('out'); import sys; print('err', file=sys.stderr)")["output"] == "out\nerr"


def test_ipython_exception_comes_back_as_an_observation(sandbox: ServerSandbox) -> None:
    observation = python(sandbox, "1 / 0")
    assert observation["error"] == "ZeroDivisionError: division by zero"
    assert "ZeroDivisionError" in observation["output"] and "\x1b[" not in observation["output"]
    assert python(sandbox, "x")["output"] == "20"


def test_ipython_timeout_interrupts_the_cell_and_keeps_the_kernel(sandbox: ServerSandbox) -> None:
    python(sandbox, "kept = 'still here'")
    started = time.monotonic()
    observation = python(sandbox, "import time\nwhile True: time.sleep(0.01)", timeout_s=1)
    assert time.monotonic() - started < 4
    assert observation["timed_out"] and "KeyboardInterrupt" in observation["output"]
    assert python(sandbox, "kept")["output"] == "'still here'"


def test_a_dying_kernel_is_reported_and_replaced(sandbox: ServerSandbox) -> None:
    started = time.monotonic()
    observation = python(sandbox, "import os; os._exit(3)")
    assert time.monotonic() - started < 5
    assert observation["error"] == "kernel died" and "variables were lost" in observation["output"]
    assert python(sandbox, "'back'")["output"] == "'back'"


def test_editor_creates_views_replaces_inserts_and_undoes(sandbox: ServerSandbox, workspace: Path) -> None:
    assert edit(sandbox, command="create", path="pkg/mod.py", file_text="a = 1\nb = 2\nc = 1\n")["error"] is None
    assert (workspace / "pkg/mod.py").read_text() == "a = 1\nb = 2\nc = 1\n"
    viewed = edit(sandbox, command="view", path="pkg/mod.py", view_range=[2, 3])
    assert viewed["output"] == "     2\tb = 2\n     3\tc = 1"
    twice = edit(sandbox, command="str_replace", path="pkg/mod.py", old_str=" = 1", new_str=" = 9")
    assert twice["error"] and "2 times" in twice["error"] and "lines 1, 3" in twice["error"]
    missing = edit(sandbox, command="str_replace", path="pkg/mod.py", old_str="zzz", new_str="")
    assert missing["error"] and "not found" in missing["error"]
    assert edit(sandbox, command="str_replace", path="pkg/mod.py", old_str="b = 2", new_str="b = 3")["error"] is None
    inserted = edit(sandbox, command="insert", path="/workspace/pkg/mod.py", insert_line=0, new_str="# top")
    assert inserted["error"] is None
    assert (workspace / "pkg/mod.py").read_text() == "# top\na = 1\nb = 3\nc = 1\n"
    edit(sandbox, command="undo_edit", path="pkg/mod.py")
    edit(sandbox, command="undo_edit", path="pkg/mod.py")
    assert (workspace / "pkg/mod.py").read_text() == "a = 1\nb = 2\nc = 1\n"
    assert "pkg/" in edit(sandbox, command="view", path=".")["output"]


def test_editor_mistakes_are_observations(sandbox: ServerSandbox) -> None:
    assert "must be one of" in edit(sandbox, command="delete", path="x")["error"]
    assert edit(sandbox, command="view", path="no/such/file")["error"]
    assert edit(sandbox, command="create", path="/etc/passwd2", file_text="x")["error"]


def test_finish_ends_the_episode_with_the_answer(sandbox: ServerSandbox) -> None:
    observation = sandbox.execute("finish", {"answer": "42"}, 5)
    assert observation["finished"] is True and observation["answer"] == "42"


def test_unknown_tools_and_bad_arguments_are_observations(sandbox: ServerSandbox) -> None:
    assert "unknown tool 'browser'" in sandbox.execute("browser", {}, 5)["error"]
    assert "needs a string argument 'command'" in sandbox.execute("bash", {"cmd": "ls"}, 5)["error"]
    assert sandbox.execute("bash", "ls", 5)["error"]  # type: ignore[arg-type]


def test_tools_not_in_the_spec_are_not_offered(tmp_path: Path) -> None:
    with create_sandbox("bwrap", SandboxSpec("j", str(tmp_path), tools=("bash",))) as box:
        assert "available tools: bash" in box.execute("ipython", {"code": "1"}, 5)["error"]


def test_tool_schemas_are_openai_functions_in_the_order_asked() -> None:
    schemas = tool_schemas(["finish", "bash"])
    assert [s["function"]["name"] for s in schemas] == ["finish", "bash"]
    for schema in TOOL_SCHEMAS.values():
        assert schema["type"] == "function"
        parameters = schema["function"]["parameters"]
        assert parameters["type"] == "object" and set(parameters["required"]) <= set(parameters["properties"])
    assert TOOL_SCHEMAS["editor"]["function"]["parameters"]["properties"]["command"]["enum"] == [
        "view", "create", "str_replace", "insert", "undo_edit",
    ]  # fmt: skip
    with pytest.raises(UnknownName, match="valid: bash, editor, finish, ipython"):
        tool_schemas(["browser"])


def test_output_helpers_cap_and_clean() -> None:
    assert cap_output("x" * 100, 1000) == "x" * 100
    capped = cap_output("a" * 500 + "b" * 500, 100)
    assert capped.startswith("a" * 50) and capped.endswith("b" * 50) and "900 bytes" in capped
    assert clean_terminal_text("50%\r100%\n\x1b[32mok\x1b[0m") == "100%\nok"
    buffer = HeadTailBuffer(4)
    for chunk in (b"abc", b"defgh", b"ijklmnop", b"qrstuvwxyz"):
        buffer.add(chunk)
    assert buffer.head == b"abcd" and buffer.tail.endswith(b"wxyz") and buffer.dropped > 0
