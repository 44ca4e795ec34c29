"""Programming tasks, HumanEval or MBPP style, graded by hidden tests in a fresh sandbox.

Task forms:
- HumanEval: ``{"prompt", "test", "entry_point"}``; the test defines ``check(candidate)``.
- MBPP: ``{"text", "test_list"}`` (+ optional ``test_setup_code``, ``test_imports``).
Both take optional ``timeout_s`` (per test, capped by ROLLOUT_EVAL_TIMEOUT_S) and ``image``.

Submission: ``{"code"}`` or ``{"answer"}``; the code is the last ```python block in it, or
all of it. HumanEval code that does not define ``entry_point`` is taken as a completion of
the prompt, as in HumanEval itself; the prompt's imports are always put in front.

Artifact: ``{"code", "source"}``, where the code is taken, in this order, from a finish
answer that names a ``.py`` file (that file, read in the agent's sandbox); an empty finish
answer (``/workspace/solution.py``); the finish answer's code; without finish, a code
block in the last message, else ``/workspace/solution.py`` if it exists.

Grading: every MBPP assert is one test, HumanEval's ``check(entry_point)`` is one test; each
runs in its own process (see ``code_runner``). Reward 1 iff all pass; ``details`` has the
pass fraction and per-test status.
"""

from __future__ import annotations

import json
import re
import secrets
import site
from pathlib import Path
from typing import Any

from rollout_service.errors import ValidationError
from rollout_service.schemas import ScoreResponse
from rollout_service.settings import get_settings
from rollout_service.tasks import TaskSetup, require
from rollout_service.tasks.sandboxed import (
    eval_budget_s,
    grading_run,
    grading_workspace,
    read_sandbox_file,
    tagged_json,
)

SOLUTION_FILE = "solution.py"
MAX_CODE_BYTES = 1024 * 1024
RUNNER = "module:rollout_service.tools.code_runner"  # stdlib only; preloaded by the sandbox fork server
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_FILE_REFERENCE = re.compile(r"^[\w./-]+\.py$")
_IMPORT_LINE = re.compile(r"^(?:import|from)\s+\S.*$", re.MULTILINE)

SYSTEM_PROMPT = (
    "You are an expert Python programmer working in a sandbox with bash, ipython and a file editor; "
    "the working directory is /workspace. Write the solution, test it, then call finish with the "
    "complete code in a ```python block (or with the path of the .py file that holds it)."
)


def extract_code(text: str, entry_point: str | None = None) -> str:
    """The code in ``text``: its last fenced block (the last defining ``entry_point`` or any
    function, when there are several), or all of ``text`` when it has no fence."""
    blocks = [body for language, body in _FENCE.findall(text) if language.lower() in ("", "python", "py", "python3")]
    if not blocks:
        return _trim(text)
    for marker in ([rf"def\s+{re.escape(entry_point)}\s*\("] if entry_point else []) + [r"\bdef\s+\w+"]:
        defining = [b for b in blocks if re.search(marker, b)]
        if defining:
            return _trim(defining[-1])
    return _trim(blocks[-1])


def _trim(code: str) -> str:
    """Without leading blank lines and trailing space; the first line keeps its indentation
    (a HumanEval completion starts inside the function body)."""
    return re.sub(r"\A(?:[ \t]*\n)+", "", code).rstrip()


def is_humaneval(task: dict[str, Any]) -> bool:
    return "test_list" not in task and "text" not in task


class CodeHandler:
    name = "code"
    prepares_cheaply = True
    tools = ("bash", "ipython", "editor", "finish")

    def offered_tools(self, task: dict[str, Any]) -> tuple[str, ...]:
        return self.tools

    def validate(self, task: dict[str, Any]) -> None:
        if is_humaneval(task):
            if not any(k in task for k in ("prompt", "test", "entry_point")):
                raise ValidationError(
                    "task.prompt, task.test and task.entry_point are required for domain "
                    "'code' (HumanEval form), or task.text and task.test_list (MBPP form)"
                )
            require(task, "prompt", str, self.name)
            require(task, "test", str, self.name)
            if not require(task, "entry_point", str, self.name).isidentifier():
                raise ValidationError(f"task.entry_point must be a function name, got {task['entry_point']!r}")
        else:
            require(task, "text", str, self.name)
            tests = require(task, "test_list", list, self.name)
            if not tests or not all(isinstance(t, str) for t in tests):
                raise ValidationError("task.test_list must be a non-empty list of assert statements (strings)")
            if task.get("test_setup_code") is not None:
                require(task, "test_setup_code", str, self.name)
            imports = task.get("test_imports")
            if imports is not None and not (isinstance(imports, list) and all(isinstance(i, str) for i in imports)):
                raise ValidationError("task.test_imports must be a list of import statements (strings)")
        timeout = task.get("timeout_s")
        if timeout is not None and not (
            isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0
        ):
            raise ValidationError(f"task.timeout_s must be a positive number of seconds, got {timeout!r}")
        if task.get("image") is not None:
            require(task, "image", str, self.name)

    def prepare(self, task: dict[str, Any], workspace: Path) -> TaskSetup:
        workspace.mkdir(parents=True, exist_ok=True)
        if is_humaneval(task):
            (workspace / SOLUTION_FILE).write_text(task["prompt"])
            user = (
                f"Complete this Python function; hidden tests will check it.\n\n```python\n"
                f"{task['prompt'].rstrip()}\n```\n\nThe stub is in /workspace/{SOLUTION_FILE}."
            )
            hint = f" When you are done, call finish with the complete code (imports and `{task['entry_point']}`)."
        else:
            user = (
                f"{task['text'].strip()}\n\nYour code should pass tests like this one:\n```python\n"
                f"{task['test_list'][0]}\n```"
            )
            hint = "\nWhen you are done, call finish with the complete code."
        return TaskSetup(
            messages=[
                {"role": "system", "content": task.get("system_prompt", SYSTEM_PROMPT)},
                {"role": "user", "content": user},
            ],
            tools=self.tools,
            image=task.get("image"),
            finish_hint=hint,
        )

    def artifact(self, task: dict[str, Any], answer: str | None, final_text: str, execute: Any) -> dict[str, Any]:
        entry_point = task.get("entry_point")
        if answer is not None:
            stripped = answer.strip()
            if not stripped or _FILE_REFERENCE.match(stripped):
                path = stripped or SOLUTION_FILE
                return self._from_file(execute, path if path.startswith("/") else f"/workspace/{path}")
            return {"code": extract_code(answer, entry_point), "source": "finish"}
        if _FENCE.search(final_text or "") or execute is None:
            return {"code": extract_code(final_text or "", entry_point), "source": "final_text"}
        from_file = self._from_file(execute, f"/workspace/{SOLUTION_FILE}")
        return from_file if from_file["code"] else {"code": (final_text or "").strip(), "source": "final_text"}

    def _from_file(self, execute: Any, path: str) -> dict[str, Any]:
        data = read_sandbox_file(execute, path, MAX_CODE_BYTES) if execute is not None else None
        return {"code": data.decode("utf-8", "replace") if data else "", "source": f"file:{path}"}

    def score(self, task: dict[str, Any], submission: dict[str, Any]) -> ScoreResponse:
        humaneval = is_humaneval(task)
        raw = submission.get("code")
        raw = submission.get("answer") if raw is None else raw
        code = extract_code(str(raw or ""), task.get("entry_point"))
        labels = [f"check({task['entry_point']})"] if humaneval else list(task["test_list"])
        details: dict[str, Any] = {
            "form": "humaneval" if humaneval else "mbpp",
            "passed": 0,
            "total": len(labels),
            "pass_fraction": 0.0,
        }
        if not code:
            return ScoreResponse(
                reward=0.0,
                details={**details, "error": 'the submission holds no code; send {"code": "..."} or {"answer": "..."}'},
            )
        program, tests = build_program(task, code)
        results, error = run_hidden_tests(program, tests, eval_budget_s(task), task.get("image"))
        passed = sum(r["status"] == "passed" for r in results)
        details.update(
            passed=passed,
            pass_fraction=passed / len(labels),
            tests=[{"test": label[:200], **result} for label, result in zip(labels, results)],
        )
        if error:
            details["error"] = error
        return ScoreResponse(reward=1.0 if results and passed == len(labels) else 0.0, details=details)


def build_program(task: dict[str, Any], code: str) -> tuple[str, list[str]]:
    """The program every test runs after, and the tests."""
    if is_humaneval(task):
        entry_point, prompt = task["entry_point"], task["prompt"]
        if not re.search(rf"def\s+{re.escape(entry_point)}\s*\(", code):
            code = prompt + code
        imports = "\n".join(_IMPORT_LINE.findall(prompt))
        return f"{imports}\n{code}\n", [f"{task['test']}\n\ncheck({entry_point})\n"]
    imports = "\n".join(task.get("test_imports") or [])
    return f"{imports}\n{code}\n\n{task.get('test_setup_code') or ''}\n", list(task["test_list"])


def run_hidden_tests(
    program: str, tests: list[str], per_test_s: float, image: str | None
) -> tuple[list[dict[str, str]], str | None]:
    """Per-test results from a fresh sandbox, and an error when the grader gave no result."""
    budget_s = get_settings().eval_timeout_s
    nonce = secrets.token_hex(16)
    # The grader runs on this host's Python without ``site``; its forked tests get its site-packages on
    # sys.path all the same. An image's own python3 runs its site.
    paths = site.getsitepackages() if image is None else []
    with grading_workspace("code", small=True) as workspace:
        (workspace / "grading.json").write_text(
            json.dumps(
                {
                    "program": program,
                    "tests": tests,
                    "timeout_s": per_test_s,
                    "budget_s": budget_s,
                    "nonce": nonce,
                    "site_paths": paths,
                }
            )
        )
        _, output = grading_run(workspace, image, budget_s, (RUNNER, "/workspace/grading.json"))
    results = tagged_json(output, nonce)
    if not isinstance(results, list) or len(results) != len(tests):
        tail = output[-500:]
        return [{"status": "not_run", "error": ""} for _ in tests], f"the grader produced no result: {tail}"
    return results, None
