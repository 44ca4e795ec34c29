"""A str_replace-style file editor: view, create, str_replace, insert, undo_edit.

Paths are relative to the workspace unless absolute. Every mistake is an observation that
says how to fix the call.
"""

from __future__ import annotations

import os

from rollout_service.tools.output import cap_output, error_observation, observation

TYPE_CHECKING = False  # the sandbox's tools do not import typing at run time
if TYPE_CHECKING:
    from typing import Any

COMMANDS = ("view", "create", "str_replace", "insert", "undo_edit")
SNIPPET_LINES = 4
MAX_DIR_ENTRIES = 500


class Editor:
    def __init__(self, workspace: str) -> None:
        self.workspace = workspace
        self._history: dict[str, list[str | None]] = {}

    def run(self, args: dict[str, Any], output_cap: int) -> dict[str, Any]:
        command = args.get("command")
        if command not in COMMANDS:
            return error_observation(f"editor command must be one of {', '.join(COMMANDS)}; got {command!r}")
        raw_path = args.get("path")
        if not isinstance(raw_path, str) or not raw_path:
            return error_observation("editor needs a 'path' (relative to the workspace or absolute)")
        path = os.path.normpath(os.path.join(self.workspace, raw_path))
        try:
            result = getattr(self, f"_{command}")(path, args)
        except (OSError, UnicodeDecodeError) as exc:
            return error_observation(f"{command} {raw_path}: {exc.strerror if isinstance(exc, OSError) else exc}")
        if isinstance(result, str):
            return observation(cap_output(result, output_cap), exit_code=0)
        return result

    def _view(self, path: str, args: dict[str, Any]) -> str | dict[str, Any]:
        if os.path.isdir(path):
            return self._list_dir(path)
        lines = _read(path).split("\n")
        start, end = 1, len(lines)
        view_range = args.get("view_range")
        if view_range is not None:
            if (
                not isinstance(view_range, list)
                or len(view_range) != 2
                or not all(isinstance(n, int) for n in view_range)
            ):
                return error_observation("view_range must be two line numbers [start, end]; end -1 means the last line")
            start, end = view_range
            end = len(lines) if end == -1 else end
            if not 1 <= start <= len(lines) or end < start:
                return error_observation(
                    f"view_range {view_range} is outside the file's {len(lines)} lines; "
                    f"use 1 <= start <= end <= {len(lines)} (or end -1)"
                )
            end = min(end, len(lines))
        return _numbered(lines[start - 1 : end], start)

    def _list_dir(self, path: str) -> str:
        entries: list[str] = []
        for root, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            depth = root[len(path) :].count(os.sep)
            if depth >= 2:
                dirs[:] = []
            rel = os.path.relpath(root, path)
            prefix = "" if rel == "." else rel + "/"
            entries += [prefix + d + "/" for d in dirs] + [prefix + f for f in sorted(files) if not f.startswith(".")]
            if len(entries) > MAX_DIR_ENTRIES:
                break
        shown = sorted(entries)[:MAX_DIR_ENTRIES]
        more = f"\n[... {len(entries) - len(shown)} more entries]" if len(entries) > len(shown) else ""
        return f"Files and directories up to 2 levels deep in {path}:\n" + "\n".join(shown) + more

    def _create(self, path: str, args: dict[str, Any]) -> str | dict[str, Any]:
        text = args.get("file_text")
        if not isinstance(text, str):
            return error_observation("create needs 'file_text' (the whole content of the new file)")
        if os.path.isdir(path):
            return error_observation(f"{path} is a directory; give a file path")
        self._remember(path, _read(path) if os.path.exists(path) else None)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _write(path, text)
        return f"File created: {path}"

    def _str_replace(self, path: str, args: dict[str, Any]) -> str | dict[str, Any]:
        old, new = args.get("old_str"), args.get("new_str", "")
        if not isinstance(old, str) or not old:
            return error_observation("str_replace needs a non-empty 'old_str' copied exactly from the file")
        if not isinstance(new, str):
            return error_observation("'new_str' must be a string")
        content = _read(path)
        count = content.count(old)
        if count == 0:
            return error_observation(
                f"old_str was not found in {path}; view the file and copy the text exactly, "
                "including whitespace and indentation"
            )
        if count > 1:
            lines = _match_lines(content, old)
            return error_observation(
                f"old_str occurs {count} times in {path} (lines {', '.join(map(str, lines))}); "
                "include more surrounding lines so it matches exactly once"
            )
        self._remember(path, content)
        at = content.index(old)
        updated = content[:at] + new + content[at + len(old) :]
        _write(path, updated)
        first = content[:at].count("\n") + 1
        return f"Edited {path}. Snippet:\n" + _snippet(updated, first, new.count("\n") + 1)

    def _insert(self, path: str, args: dict[str, Any]) -> str | dict[str, Any]:
        line, new = args.get("insert_line"), args.get("new_str")
        if not isinstance(new, str):
            return error_observation("insert needs 'new_str' (the text to insert)")
        content = _read(path)
        lines = content.split("\n")
        if not isinstance(line, int) or not 0 <= line <= len(lines):
            return error_observation(
                f"insert_line must be a line number from 0 (top of file) to {len(lines)}; got {line!r}"
            )
        self._remember(path, content)
        updated = "\n".join(lines[:line] + new.split("\n") + lines[line:])
        _write(path, updated)
        return f"Inserted after line {line} of {path}. Snippet:\n" + _snippet(updated, line + 1, new.count("\n") + 1)

    def _undo_edit(self, path: str, args: dict[str, Any]) -> str | dict[str, Any]:
        history = self._history.get(path)
        if not history:
            return error_observation(f"no edit of {path} to undo")
        previous = history.pop()
        if previous is None:
            os.unlink(path)
            return f"Undid the creation of {path} (file removed)"
        _write(path, previous)
        return f"Undid the last edit of {path}. Now:\n" + _numbered(previous.split("\n"), 1)

    def _remember(self, path: str, content: str | None) -> None:
        self._history.setdefault(path, []).append(content)


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _numbered(lines: list[str], first: int) -> str:
    return "\n".join(f"{n:6}\t{line}" for n, line in enumerate(lines, first))


def _snippet(content: str, first_line: int, n_lines: int) -> str:
    lines = content.split("\n")
    start = max(1, first_line - SNIPPET_LINES)
    end = min(len(lines), first_line + n_lines - 1 + SNIPPET_LINES)
    return _numbered(lines[start - 1 : end], start)


def _match_lines(content: str, needle: str) -> list[int]:
    lines, at = [], content.find(needle)
    while at != -1:
        lines.append(content[:at].count("\n") + 1)
        at = content.find(needle, at + 1)
    return lines
