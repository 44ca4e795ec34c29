"""The tools as the model sees them: OpenAI function-calling schemas for the chat template."""

from __future__ import annotations

from collections.abc import Iterable

from rollout_service.errors import UnknownName


def _function(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


TOOL_SCHEMAS: dict[str, dict] = {
    "bash": _function(
        "bash",
        "Run a command in a persistent bash shell in /workspace. The working directory, environment "
        "variables and functions persist between calls. Commands have no terminal input (stdin is "
        "empty), long-running commands are interrupted at the time limit, and long output is cut in "
        "the middle.",
        {"command": {"type": "string", "description": "The bash command(s) to run."}},
        ["command"],
    ),
    "ipython": _function(
        "ipython",
        "Run Python code in a persistent IPython kernel (variables and imports persist between "
        "calls). The value of the last expression is shown, like in a notebook cell.",
        {"code": {"type": "string", "description": "The Python code to run."}},
        ["code"],
    ),
    "editor": _function(
        "editor",
        "View, create and edit files. `view` shows a file with line numbers (or lists a directory); "
        "`create` writes a new file; `str_replace` replaces `old_str`, which must occur exactly once, "
        "with `new_str`; `insert` adds `new_str` after line `insert_line` (0 = top); `undo_edit` "
        "reverts the last edit of the file. Relative paths are relative to /workspace.",
        {
            "command": {
                "type": "string",
                "enum": ["view", "create", "str_replace", "insert", "undo_edit"],
                "description": "The editing operation.",
            },
            "path": {"type": "string", "description": "The file or directory."},
            "file_text": {"type": "string", "description": "`create`: the content of the file."},
            "old_str": {"type": "string", "description": "`str_replace`: the exact text to replace."},
            "new_str": {"type": "string", "description": "`str_replace`, `insert`: the new text."},
            "insert_line": {"type": "integer", "description": "`insert`: the line after which to insert."},
            "view_range": {
                "type": "array",
                "items": {"type": "integer"},
                "description": "`view`: [first, last] line to show; last -1 means the end of the file.",
            },
        },
        ["command", "path"],
    ),
    "finish": _function(
        "finish",
        "End the episode and submit the final answer. Call it once, when done.",
        {"answer": {"type": "string", "description": "The final answer."}},
        ["answer"],
    ),
}


def tool_schemas(names: Iterable[str]) -> list[dict]:
    """The schemas of ``names``, in that order, ready for the chat template's ``tools``: the shared
    ones, read only (every episode's prompt renders them; a copy each would add to every prompt's cost)."""
    schemas = []
    for name in names:
        if name not in TOOL_SCHEMAS:
            raise UnknownName("tool", name, TOOL_SCHEMAS)
        schemas.append(TOOL_SCHEMAS[name])
    return schemas
