"""What a process does first inside a sandbox: resource limits, and the switch to the sandbox's
own uid when started as root. Stdlib only (it runs on any image with the runtime bound in).

The action server calls it before serving tools. A one-shot sandbox (``SandboxSpec.script``: a
grader) runs it as its entry point, then the script: a Python one in the same interpreter (no
tool server, no shell, no second Python start), any other program in its place.

    python -I -S -c BOOTSTRAP --memory-mb 2048 --cpu-time-s 60 --max-procs 256 \
        --workspace /workspace --argv /workspace/grader.py --argv /workspace/grading.json [--user UID:GID]
"""

from __future__ import annotations

import os
import resource
import sys


def apply_limits(memory_mb: int, cpu_time_s: int, max_procs: int) -> None:
    limits = [(resource.RLIMIT_CORE, 0)]
    if memory_mb > 0:
        limits.append((resource.RLIMIT_AS, memory_mb * 1024 * 1024))
    if cpu_time_s > 0:
        limits.append((resource.RLIMIT_CPU, cpu_time_s))
    if max_procs > 0:
        limits.append((resource.RLIMIT_NPROC, max_procs))
    for kind, value in limits:
        _, hard = resource.getrlimit(kind)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(kind, (value, value))


def drop_privileges(user: str) -> None:
    uid, gid = (int(part) for part in user.split(":"))
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise SystemExit(f"could not drop privileges to {user}")


def run_script(argv: list[str] | None = None) -> None:
    """Confine this process as the options say, then run ``--argv``: a Python script (``*.py``) in
    this interpreter, anything else as a program that replaces it (e.g. ``bash grade.sh``)."""
    argv = sys.argv[1:] if argv is None else argv
    options: dict[str, str] = {"memory-mb": "0", "cpu-time-s": "0", "max-procs": "0", "user": "", "workspace": ""}
    script: list[str] = []
    if len(argv) % 2:
        raise SystemExit(f"every option needs a value: {argv}")
    for flag, value in zip(argv[::2], argv[1::2]):
        name = flag[2:] if flag.startswith("--") else ""
        if name == "argv":
            script.append(value)
        elif name in options:
            options[name] = value
        else:
            raise SystemExit(f"unknown option {flag!r}; expected --argv or --{' --'.join(options)}")
    if not script:
        raise SystemExit("--argv SCRIPT is required")
    apply_limits(int(options["memory-mb"]), int(options["cpu-time-s"]), int(options["max-procs"]))
    if options["user"]:
        drop_privileges(options["user"])
    os.umask(0o022)
    if options["workspace"]:
        os.chdir(options["workspace"])
    sys.exit(run(script))


MODULE_PREFIX = "module:"


def exit_status(exc: SystemExit) -> int:
    """The status Python exits with for ``exc``, writing a message to stderr as Python does."""
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    sys.stderr.write(f"{exc.code}\n")
    return 1


def runs_in_process(script: list[str]) -> bool:
    """Whether ``run`` runs ``script`` in this interpreter (a Python file or module) or execs it."""
    return script[0].endswith(".py") or script[0].startswith(MODULE_PREFIX)


def run(script: list[str]) -> int:
    """Run ``script``: a Python file (``*.py``) or ``module:NAME`` (``NAME.main(*arguments)``, with the
    module imported as usual, so a server that preloaded it pays nothing) in this interpreter, and
    return 0; anything else is exec'd in place of this process."""
    if not runs_in_process(script):
        os.execvp(script[0], script)
    sys.argv = list(script)
    if script[0].startswith(MODULE_PREFIX):
        import importlib

        importlib.import_module(script[0][len(MODULE_PREFIX) :]).main(*script[1:])
        return 0
    import runpy

    runpy.run_path(script[0], run_name="__main__")
    return 0
