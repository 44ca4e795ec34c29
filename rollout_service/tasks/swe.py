"""Software-engineering tasks: SWE-bench rows (full, Lite, Verified; SWE-Gym, SWE-smith) as
published, graded exactly like the SWE-bench harness.

Task: a row as published (``instance_id, repo, version, problem_statement, base_commit,
test_patch, FAIL_TO_PASS, PASS_TO_PASS`` with the test lists as JSON strings or lists; every other
field, ``patch`` and ``hints_text`` included, is accepted and never shown to the policy), plus
where the repository is:
- ``image`` (or none, with ROLLOUT_SWE_IMAGE_TEMPLATE): the instance's environment image, the
  repository at ``repo_dir`` (default /testbed) checked out at ``base_commit``. The agent's
  sandbox is made from it (on the run node, from its image cache: nothing crosses nodes) with
  that repository pinned: nothing after ``base_commit`` is in it. Grading runs the harness's eval
  script for the row's repo and version (``swe_harness``) in a fresh sandbox of the same image.
- or ``repo_path``: a local git repository on the workers' file system; init fetches the history
  up to ``base_commit`` into the job's workspace (/workspace); graded with ``test_cmd`` (default
  pytest ``-rA``), whose pytest summary is parsed.
Optional: ``test_cmd`` (an image task then grades with it instead of the harness's),
``timeout_s`` for the test run.

Artifact: ``{"patch", "answer"}``; the patch is ``git add -A && git diff --cached base_commit``,
computed inside the agent's sandbox (never by git on the host, where hooks and config the
agent planted would run). Submission for ``POST /v1/score``: ``{"patch"}`` (or ``model_patch``).

Resolved (reward 1) iff every FAIL_TO_PASS and every PASS_TO_PASS test passed (PASSED or XFAIL),
as the harness counts.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from rollout_service.errors import TaskError, ValidationError
from rollout_service.images import instance_image_name, parse_image
from rollout_service.sandbox.image_root import PINNED_HEAD_FILE
from rollout_service.schemas import ScoreResponse
from rollout_service.settings import get_settings
from rollout_service.tasks import TaskSetup, require, swe_harness
from rollout_service.tasks.sandboxed import (
    eval_budget_s,
    grading_run,
    grading_workspace,
    read_sandbox_file,
    read_untrusted_file,
    sandbox_path,
    shell,
)

DEFAULT_IMAGE_REPO_DIR = "/testbed"
PYTEST_ARGS = "-m pytest -rA -p no:cacheprovider"
MAX_PATCH_BYTES = 8 * 1024 * 1024
MAX_LOG_BYTES = 8 * 1024 * 1024
LOG_TAIL_CHARS = 2000
ARTIFACT_PATCH = (
    "/tmp/rollout-artifact-{}.patch"  # one per extraction, removed after: /tmp is the host's in a local sandbox
)
SAFE_GIT = "git -c core.hooksPath=/dev/null -c core.fsmonitor=false"
CONDA_TESTBED_ENV = {  # the agent's shell in a SWE-bench-style image: the instance's env active, as after `conda activate testbed`
    "PATH": "/opt/miniconda3/envs/testbed/bin:/opt/miniconda3/condabin:$PATH",
    "CONDA_DEFAULT_ENV": "testbed",
    "CONDA_PREFIX": "/opt/miniconda3/envs/testbed",
}
IGNORED_IN_DIFF = ("__pycache__/", "*.pyc", ".pytest_cache/", "*.egg-info/")
PASSING = {"PASSED", "XFAIL"}
_STATUS_LINE = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (.+?)\s*$", re.MULTILINE)
_STAGE = re.compile(r"ROLLOUT-STAGE ([\w-]+)(?: (\d+))?")
_SHA = re.compile(r"[0-9a-fA-F]{7,40}")

SYSTEM_PROMPT = (
    "You are a software engineer fixing an issue in a repository, in a sandbox with bash and a file "
    "editor. Find the cause, change the source code (not the existing tests), check your fix, then "
    "call finish. Your changes are collected with git diff."
)


def test_ids(task: dict[str, Any], name: str) -> list[str]:
    """A SWE-bench test list: a list of pytest node ids, or the same JSON-encoded in a string."""
    value = task.get(name)
    if value is None:
        raise ValidationError(f"task.{name} is required for domain 'swe' (a list of pytest node ids)")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValidationError(
                f"task.{name} is a string but not JSON: give a list of pytest node ids or its JSON encoding"
            ) from None
    if not isinstance(value, list) or not all(isinstance(t, str) and t for t in value):
        raise ValidationError(f"task.{name} must be a list of pytest node ids (strings)")
    return value


def task_image(task: dict[str, Any]) -> str | None:
    """The task's image: ``task.image``, or for a task without ``repo_path`` the one its
    ``image_template`` (a request's default), else ROLLOUT_SWE_IMAGE_TEMPLATE, names for its
    instance; None for a repo_path task."""
    if task.get("image") is not None:
        return str(task["image"])
    template = task.get("image_template") or get_settings().swe_image_template
    if (
        task.get("repo_path") is None
        and isinstance(template, str)
        and template
        and isinstance(task.get("instance_id"), str)
    ):
        return instance_image_name(template, task["instance_id"])
    return None


def graded_by_harness(task: dict[str, Any]) -> bool:
    """An image task without its own test_cmd: graded by the SWE-bench harness's eval script."""
    return task_image(task) is not None and task.get("test_cmd") is None


def touched_files(patch: str) -> list[str]:
    """Every path a unified diff touches, old and new names alike (without /dev/null)."""
    paths: list[str] = []
    names: tuple[str, ...]
    for line in patch.splitlines():
        if line.startswith("diff --git "):
            found = re.match(r"diff --git a/(.+) b/(.+)$", line)
            names = found.groups() if found else ()
        elif line.startswith(("--- ", "+++ ")):
            name = line[4:].split("\t")[0].strip()
            names = (name[2:],) if name[:2] in ("a/", "b/") else ()
        else:
            continue
        paths += names
    return [p for p in dict.fromkeys(paths) if p != "dev/null"]


def parse_pytest_log(log: str, wanted: list[str]) -> dict[str, str]:
    """Status of each wanted node id in a pytest ``-rA`` log; a later line wins (the summary
    comes last). A failure line is ``FAILED <id> - <message>``, so ids are matched as prefixes."""
    wanted_set = set(wanted)
    statuses: dict[str, str] = {}
    for status, rest in _STATUS_LINE.findall(log):
        if rest in wanted_set:
            statuses[rest] = status
            continue
        for match in re.finditer(r" - ", rest):
            if rest[: match.start()] in wanted_set:
                statuses[rest[: match.start()]] = status
                break
    return statuses


def git(*args: str, cwd: Path | None = None, check: bool = True) -> str:
    """Run git on the host, on repositories the service made or the operator gave (never the agent's)."""
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "GIT_CONFIG_NOSYSTEM": "1"}
    result = subprocess.run(
        ["git", "-c", "core.hooksPath=/dev/null", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if check and result.returncode != 0:
        raise TaskError(f"git {' '.join(args[:3])} failed: {result.stderr.strip()[-500:]}")
    return result.stdout


def _is_under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def allowed_repo_path(repo_path: str) -> str:
    """``repo_path`` resolved (symlinks, ``..``), if it is under a directory the operator allows
    (the state directory, ROLLOUT_REPO_ROOTS) and not a job's workspace (an agent writes there)."""
    settings = get_settings()
    resolved = os.path.realpath(repo_path)
    workspaces = os.path.realpath(settings.workspaces_path)
    if _is_under(resolved, workspaces):
        raise ValidationError(
            f"task.repo_path {repo_path} is in the jobs' workspace directory {workspaces}, "
            "which agents write: give a repository the operator put in place"
        )
    roots = settings.repo_root_paths
    if not any(_is_under(resolved, root) for root in roots):
        raise ValidationError(
            f"task.repo_path {repo_path}{f' (resolved: {resolved})' if resolved != repo_path else ''} is outside "
            f"the directories repositories may be read from ({', '.join(roots)}); put the repository under one "
            "of them, or have the operator add its directory to ROLLOUT_REPO_ROOTS"
        )
    return resolved


def materialize(repo_path: str, commit: str, target: Path, shallow: bool) -> str:
    """A new repository in ``target`` holding ``commit`` (and, unless shallow, its history, but
    nothing after it) checked out on branch ``main``. Returns the full commit id. ``repo_path`` is
    checked again here: the worker runs as root and must read only what the operator allows."""
    source = Path(allowed_repo_path(repo_path))
    if not (source / ".git").exists() and not (source / "HEAD").exists():
        raise TaskError(
            f"task.repo_path {repo_path} is not a git repository on this worker; give a path "
            "that every init and eval worker can read"
        )
    sha = git(
        "-c",
        f"safe.directory={source}",
        "-C",
        str(source),
        "rev-parse",
        "--verify",
        "--quiet",
        f"{commit}^{{commit}}",
        check=False,
    ).strip()
    if not sha:
        raise TaskError(f"task.base_commit {commit} is not a commit of {repo_path}")
    target.mkdir(parents=True, exist_ok=True)
    git("init", "-q", str(target))
    git(
        "-c",
        "protocol.version=2",
        "-c",
        f"safe.directory={source}",
        "-C",
        str(target),
        "fetch",
        "-q",
        "--no-tags",
        *(["--depth", "1"] if shallow else []),
        str(source),
        sha,
    )
    git("-C", str(target), "checkout", "-q", "-B", "main", sha)
    git("-C", str(target), "config", "user.name", "rollout-agent")
    git("-C", str(target), "config", "user.email", "agent@rollout.invalid")
    (target / ".git" / "FETCH_HEAD").unlink(missing_ok=True)
    info = target / ".git" / "info"
    info.mkdir(exist_ok=True)
    with open(info / "exclude", "a") as f:
        f.write("\n".join(IGNORED_IN_DIFF) + "\n")
    return sha


def clear_directory(path: Path) -> None:
    """Empty ``path``, or make it (a redelivered init starts from scratch)."""
    path.mkdir(parents=True, exist_ok=True)
    for entry in path.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


class SweHandler:
    name = "swe"
    prepares_cheaply = False
    tools = ("bash", "editor", "finish")

    def offered_tools(self, task: dict[str, Any]) -> tuple[str, ...]:
        return self.tools

    def validate(self, task: dict[str, Any]) -> None:
        require(task, "instance_id", str, self.name)
        require(task, "problem_statement", str, self.name)
        if not _SHA.fullmatch(require(task, "base_commit", str, self.name)):
            raise ValidationError(
                f"task.base_commit must be a commit id (7 to 40 hex digits), got {task['base_commit']!r}"
            )
        require(task, "test_patch", str, self.name)
        if not test_ids(task, "FAIL_TO_PASS"):
            raise ValidationError("task.FAIL_TO_PASS must name at least one test")
        test_ids(task, "PASS_TO_PASS")
        for name in ("image", "image_template", "test_cmd", "repo_path", "repo_dir"):
            if task.get(name) is not None:
                require(task, name, str, self.name)
        if task.get("repo_dir") is not None and not os.path.isabs(task["repo_dir"]):
            raise ValidationError(f"task.repo_dir must be an absolute path inside the image, got {task['repo_dir']!r}")
        timeout = task.get("timeout_s")
        if timeout is not None and not (
            isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0
        ):
            raise ValidationError(f"task.timeout_s must be a positive number of seconds, got {timeout!r}")
        if task.get("repo_path") is not None:
            if not os.path.isabs(task["repo_path"]):
                raise ValidationError(f"task.repo_path must be an absolute path, got {task['repo_path']!r}")
            allowed_repo_path(task["repo_path"])
            return
        image = task_image(task)
        if image is None:
            raise ValidationError(
                "task.image is required for domain 'swe' (the instance's environment image: docker://REF, "
                "oci:DIR:TAG, oci-archive:FILE, docker-archive:FILE), unless ROLLOUT_SWE_IMAGE_TEMPLATE names "
                "one per instance; or task.repo_path, a local git repository"
            )
        field = next(
            (f"task.{name}" for name in ("image", "image_template") if task.get(name) is not None),
            "ROLLOUT_SWE_IMAGE_TEMPLATE",
        )
        parse_image(image, field)
        if graded_by_harness(task):
            for name in ("repo", "version"):
                if not isinstance(task.get(name), str):
                    raise ValidationError(
                        f"task.{name} is required for an image task graded by the SWE-bench harness "
                        "(as in the published row), or give task.test_cmd"
                    )
            swe_harness.eval_script(task, self.repo_dir(task))

    def grading_limit_s(self, task: dict[str, Any]) -> float:
        """An image task's tests get the harness's time (swe_eval_timeout_s), a repo_path task's eval_timeout_s."""
        settings = get_settings()
        return eval_budget_s(task, settings.swe_eval_timeout_s if task_image(task) else None)

    def prepares_cheaply_for(self, task: dict[str, Any]) -> bool:
        """An image task prepares nothing on disk: the run stage prepares it on its own node."""
        return task.get("repo_path") is None and task_image(task) is not None

    def prepare(self, task: dict[str, Any], workspace: Path) -> TaskSetup:
        repo_dir = self.repo_dir(task)
        image = None
        extra: dict[str, Any] = {"repo_dir": repo_dir}
        if task.get("repo_path"):
            clear_directory(workspace)
            materialize(task["repo_path"], task["base_commit"], workspace, shallow=False)
        else:
            image = task_image(task)
            extra.update(workdir=repo_dir, pin_repo=[repo_dir, task["base_commit"]], env=dict(CONDA_TESTBED_ENV))
        user = (
            f"{task['problem_statement'].strip()}\n\nThe repository is checked out at {repo_dir} "
            f"(commit {task['base_commit'][:12]}). Resolve the issue by changing the source code; "
            "hidden tests will check it."
        )
        return TaskSetup(
            messages=[
                {"role": "system", "content": task.get("system_prompt", SYSTEM_PROMPT)},
                {"role": "user", "content": user},
            ],
            tools=self.tools,
            image=image,
            extra=extra,
            finish_hint=" When you are done, call finish.",
        )

    @staticmethod
    def repo_dir(task: dict[str, Any], workspace: str = "/workspace") -> str:
        return workspace if task.get("repo_path") else task.get("repo_dir") or DEFAULT_IMAGE_REPO_DIR

    def artifact(self, task: dict[str, Any], answer: str | None, final_text: str, execute: Any) -> dict[str, Any]:
        if execute is None:
            return {"patch": "", "answer": answer, "error": "no sandbox ran, so nothing changed"}
        repo = sandbox_path(self.repo_dir(task))
        patch_file = ARTIFACT_PATCH.format(uuid.uuid4().hex)
        # against the commit the image's repository was at (base_commit, or the commit SWE-bench's image
        # setup made on it): what the grader's fresh copy of the image starts from
        base = (
            f'"$(cat "$({SAFE_GIT} rev-parse --git-dir)/{PINNED_HEAD_FILE}" 2>/dev/null || echo {task["base_commit"]})"'
        )
        try:
            diff = shell(
                execute,
                f"cd {repo} && {SAFE_GIT} add -A && {SAFE_GIT} --no-pager diff --cached "
                f"--no-color --no-ext-diff --no-textconv --binary {base} > {patch_file}",
            )
            if diff.get("exit_code") != 0:
                return {
                    "patch": "",
                    "answer": answer,
                    "error": f"git diff failed in the sandbox: {diff.get('output', '')[-500:]}",
                }
            data = read_sandbox_file(execute, patch_file, MAX_PATCH_BYTES) or b""
        finally:
            shell(execute, f"rm -f {patch_file}")
        return {"patch": data.decode("utf-8", "replace"), "answer": answer}

    def score(self, task: dict[str, Any], submission: dict[str, Any]) -> ScoreResponse:
        fail_to_pass, pass_to_pass = test_ids(task, "FAIL_TO_PASS"), test_ids(task, "PASS_TO_PASS")
        patch = submission.get("patch")
        patch = submission.get("model_patch") if patch is None else patch
        if not isinstance(patch, str) or not patch.strip():
            return self._report(fail_to_pass, pass_to_pass, {}, "empty-patch", "", "")
        image, by_harness = task_image(task), graded_by_harness(task)
        budget_s = self.grading_limit_s(task)
        with grading_workspace("swe") as workspace:
            if task.get("repo_path"):
                materialize(task["repo_path"], task["base_commit"], workspace / "repo", shallow=True)
            repo_dir = self.repo_dir(task, "/workspace/repo")
            (workspace / "model.patch").write_text(patch if patch.endswith("\n") else patch + "\n")
            (workspace / "test.patch").write_text(task["test_patch"])
            if by_harness:
                (workspace / "eval.sh").write_text(swe_harness.eval_script(task, repo_dir))
                script = harness_grading_script(repo_dir, budget_s)
            else:
                script = grading_script(task, repo_dir, fail_to_pass + pass_to_pass, budget_s)
            (workspace / "grade.sh").write_text(script)
            _, output = grading_run(workspace, image, budget_s, ("bash", "/workspace/grade.sh"))
            log = read_untrusted_file(workspace / "test.log", MAX_LOG_BYTES)
            apply_log = read_untrusted_file(workspace / "apply.log", LOG_TAIL_CHARS)
        stages = _STAGE.findall(output)
        stage = "-".join(filter(None, stages[-1])) if stages else "grader-timeout"
        if not by_harness:
            statuses = parse_pytest_log(log, fail_to_pass + pass_to_pass)
            return self._report(fail_to_pass, pass_to_pass, statuses, stage, log, apply_log)
        statuses = swe_harness.test_statuses(task, log) if stage.startswith("tests-exited") else {}
        resolved = stage.startswith("tests-exited") and swe_harness.resolution(task, statuses)["resolved"]
        return self._report(fail_to_pass, pass_to_pass, statuses, stage, log, apply_log, resolved)

    @staticmethod
    def _report(
        fail_to_pass: list[str],
        pass_to_pass: list[str],
        statuses: dict[str, str],
        stage: str,
        log: str,
        apply_log: str,
        resolved: bool | None = None,
    ) -> ScoreResponse:
        f2p = [t for t in fail_to_pass if statuses.get(t) in PASSING]
        p2p = [t for t in pass_to_pass if statuses.get(t) in PASSING]
        if resolved is None:
            ran = stage.startswith("tests-exited")
            resolved = ran and len(f2p) == len(fail_to_pass) and len(p2p) == len(pass_to_pass)
        details: dict[str, Any] = {
            "resolved": resolved,
            "patch_applied": stage not in ("empty-patch", "patch-failed", "no-repo", "grader-timeout"),
            "stage": stage,
            "FAIL_TO_PASS": {"passed": len(f2p), "total": len(fail_to_pass)},
            "PASS_TO_PASS": {"passed": len(p2p), "total": len(pass_to_pass)},
            "tests": {t: statuses.get(t, "missing") for t in fail_to_pass + pass_to_pass},
        }
        if stage in ("patch-failed", "test-patch-failed", "no-repo"):
            details["apply_log"] = apply_log[-LOG_TAIL_CHARS:]
        if not resolved and log:
            details["log_tail"] = log[-LOG_TAIL_CHARS:]
        return ScoreResponse(reward=1.0 if resolved else 0.0, details=details)


def harness_grading_script(repo_dir: str, budget_s: float) -> str:
    """Apply the model patch with the harness's fallbacks, then run the harness's eval script
    (/workspace/eval.sh), its output to /workspace/test.log, each step announced by a
    ``ROLLOUT-STAGE`` line."""
    attempts = "\n".join(
        f"  {command} /workspace/model.patch >> /workspace/apply.log 2>&1 && {{ applied=1; break; }}"
        for command in swe_harness.apply_patch_commands()
    )
    return f"""#!/bin/bash
cd {shlex.quote(repo_dir)} || {{ echo "ROLLOUT-STAGE no-repo"; exit 0; }}
applied=""
for _ in once; do
{attempts}
done
if [ -n "$applied" ]; then echo "ROLLOUT-STAGE patch-applied"; else echo "ROLLOUT-STAGE patch-failed"; exit 0; fi
echo "ROLLOUT-STAGE tests-started"
timeout -k 5 {budget_s:g} bash /workspace/eval.sh > /workspace/test.log 2>&1
echo "ROLLOUT-STAGE tests-exited $?"
"""


def grading_script(task: dict[str, Any], repo_dir: str, tests: list[str], budget_s: float) -> str:
    """Apply the patch, reset what the test patch touches, apply the test patch, run the tests.
    Each step prints a ``ROLLOUT-STAGE`` line; the test output goes to /workspace/test.log."""
    base = task["base_commit"]
    default_python = shlex.quote(sys.executable) if task.get("repo_path") or not task.get("image") else "python"
    test_cmd = task.get("test_cmd") or f"{default_python} {PYTEST_ARGS}"
    reset_files = " ".join(shlex.quote(f) for f in touched_files(task["test_patch"]))
    return f"""#!/bin/bash
G="{SAFE_GIT}"
cd {shlex.quote(repo_dir)} || {{ echo "ROLLOUT-STAGE no-repo"; exit 0; }}
if $G apply --verbose --whitespace=nowarn /workspace/model.patch > /workspace/apply.log 2>&1 || \\
   $G apply --verbose --whitespace=nowarn --recount --ignore-whitespace /workspace/model.patch >> /workspace/apply.log 2>&1
then echo "ROLLOUT-STAGE patch-applied"
else echo "ROLLOUT-STAGE patch-failed"; exit 0
fi
for f in {reset_files}; do
  if $G cat-file -e {base}:"$f" 2>/dev/null; then $G checkout -q {base} -- "$f"; else rm -rf -- "$f"; fi
done
if [ -s /workspace/test.patch ] && ! $G apply --verbose --whitespace=nowarn /workspace/test.patch \\
     >> /workspace/apply.log 2>&1
then echo "ROLLOUT-STAGE test-patch-failed"; exit 0
fi
echo "ROLLOUT-STAGE tests-started"
timeout -k 5 {budget_s:g} {test_cmd} {" ".join(shlex.quote(t) for t in tests)} > /workspace/test.log 2>&1
echo "ROLLOUT-STAGE tests-exited $?"
"""
