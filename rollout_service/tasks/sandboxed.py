"""What graders and artifact extractors share: a fresh, limited sandbox for grading, shell
commands in a live sandbox, and reading files that untrusted code may have touched.

Grading never reuses the agent's sandbox: ``grading_run`` runs the grader in a new one-shot
sandbox on a fresh workspace, with the eval time limit and the sandbox memory limit.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import os
import shlex
import shutil
import stat
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rollout_service.errors import TaskError
from rollout_service.settings import get_settings

SANDBOX_GRACE_S = 15.0
INNER_WORKSPACE = "/workspace"
READ_CHUNK_BYTES = 16 * 1024


def eval_budget_s(task: dict[str, Any], limit: float | None = None) -> float:
    """Seconds the graded code may run: ``task.timeout_s`` if given, never above ``limit``
    (default: eval_timeout_s)."""
    limit = get_settings().eval_timeout_s if limit is None else limit
    requested = task.get("timeout_s")
    return min(float(requested), limit) if requested else limit


@contextlib.contextmanager
def grading_workspace(prefix: str, small: bool = False) -> Iterator[Path]:
    """A new, empty host directory for one grading run; removed afterwards. ``small``: it holds a few
    files (memory-backed scratch space by default), not a repository."""
    from rollout_service.sandbox.processes import make_scratch_dir

    path = Path(make_scratch_dir(prefix, None if small else tempfile.gettempdir()))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def grading_run(workspace: Path, image: str | None, budget_s: float, script: tuple[str, ...]) -> tuple[int | None, str]:
    """Run ``script`` (a program or ``*.py`` and its arguments, as seen inside) in a fresh one-shot
    sandbox on ``workspace`` with the eval limits; no tool server is started for it. Returns (exit
    code, None if it ran out of time; its output)."""
    from rollout_service.sandbox import SandboxSpec, create_sandbox

    settings = get_settings()
    spec = SandboxSpec(
        job_id=f"grade-{uuid.uuid4().hex[:12]}",
        workspace=str(workspace),
        image=image,
        tools=(),
        memory_mb=settings.sandbox_memory_mb,
        cpu_time_s=math.ceil(budget_s + SANDBOX_GRACE_S),
        max_procs=settings.sandbox_max_procs,
        ttl_s=budget_s + 4 * SANDBOX_GRACE_S,
        script=script,
    )
    return create_sandbox(settings.sandbox, spec, None).run(budget_s + SANDBOX_GRACE_S)


def shell(execute: Any, command: str, timeout_s: float | None = None) -> dict[str, Any]:
    """Run ``command`` in a live sandbox through its bash tool, or through ipython when bash
    is not among the sandbox's tools. Returns the observation."""
    timeout_s = timeout_s or get_settings().tool_timeout_s
    observation = execute.execute("bash", {"command": command}, timeout_s=timeout_s)
    if not _unknown_tool(observation):
        return observation
    code = (
        "import subprocess, sys\n"
        f"_r = subprocess.run(['bash', '-c', {command!r}], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)\n"
        "sys.stdout.write(_r.stdout.decode('utf-8', 'replace')); print(f'\\n__exit__={_r.returncode}')"
    )
    observation = execute.execute("ipython", {"code": code}, timeout_s=timeout_s)
    if _unknown_tool(observation):
        raise TaskError(
            "extracting the artifact needs a shell in the sandbox: keep 'bash' (or 'ipython') in agent.tools"
        )
    output, _, exit_line = observation.get("output", "").rpartition("__exit__=")
    exit_code = int(exit_line.strip()) if exit_line.strip().lstrip("-").isdigit() else None
    return {**observation, "output": output.rstrip("\n"), "exit_code": exit_code}


def _unknown_tool(observation: dict[str, Any]) -> bool:
    return bool(observation.get("error")) and "unknown tool" in str(observation.get("error"))


def sandbox_path(path: str) -> str:
    """``path`` quoted for the sandbox's shell, ``/workspace`` being the job's workspace as the sandbox
    sees it (``$ROLLOUT_WORKSPACE``: a host path in a local sandbox, where /workspace is nobody's)."""
    if path == INNER_WORKSPACE or path.startswith(INNER_WORKSPACE + "/"):
        rest = path[len(INNER_WORKSPACE) :]
        return f'"${{ROLLOUT_WORKSPACE:-{INNER_WORKSPACE}}}"' + (shlex.quote(rest) if rest else "")
    return shlex.quote(path)


def read_sandbox_file(execute: Any, path: str, max_bytes: int) -> bytes | None:
    """The bytes of ``path`` inside a live sandbox, read in base64 chunks small enough for the
    tool output cap; None when it is not a regular file. Raises TaskError past ``max_bytes``."""
    quoted = sandbox_path(path)
    probe = shell(execute, f"test -f {quoted} && ! test -L {quoted} && wc -c < {quoted}")
    size_text = probe.get("output", "").strip().splitlines()[-1:] or [""]
    if probe.get("exit_code") != 0 or not size_text[0].isdigit():
        return None
    size = int(size_text[0])
    if size > max_bytes:
        raise TaskError(f"{path} has {size} bytes, more than the {max_bytes} an artifact may have")
    chunk = max(min(READ_CHUNK_BYTES, get_settings().tool_output_cap_bytes * 2 // 3), 1024)
    data = bytearray()
    while len(data) < size:
        observation = shell(execute, f"tail -c +{len(data) + 1} {quoted} 2>/dev/null | head -c {chunk} | base64 -w0")
        try:
            piece = base64.b64decode("".join(observation.get("output", "").split()), validate=True)
        except ValueError:
            raise TaskError(f"reading {path} in the sandbox failed: {observation.get('output', '')[-300:]}") from None
        if not piece:
            break  # the file shrank while being read
        data += piece
    return bytes(data)


def read_untrusted_file(path: Path, max_bytes: int) -> str:
    """Text of a file that sandboxed code could have replaced: no symlinks, no FIFOs, capped;
    "" when it is missing or not a regular file. Only the last ``max_bytes`` are kept."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return ""
        os.lseek(fd, max(0, info.st_size - max_bytes), os.SEEK_SET)
        data = os.read(fd, max_bytes)
    finally:
        os.close(fd)
    return data.decode("utf-8", "replace")


def tagged_json(output: str, tag: str) -> Any | None:
    """The JSON value after the last ``tag`` in ``output`` (a grader's result line), or None."""
    head, found, rest = output.rpartition(tag)
    if not found:
        return None
    try:
        return json.loads(rest.strip().splitlines()[0])
    except (ValueError, IndexError):
        return None
