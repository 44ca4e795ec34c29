"""The action server: runs inside a sandbox and executes tool calls sent over a Unix socket.

    python -m rollout_service.tools.action_server --socket /run/rollout/action.sock --workspace /workspace

Protocol: one JSON object per line each way. A request is ``{"tool", "args", "timeout_s",
"output_cap"}``; the answer is an observation (see ``rollout_service.tools.output``). Tool calls
run one at a time. Prints ``ready`` on stdout once it accepts connections. Imports only the
stdlib and ptyprocess at start-up, so it runs on any image that has the runtime installed.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading

from rollout_service.tools.confine import apply_limits, drop_privileges
from rollout_service.tools.output import error_observation, observation

TYPE_CHECKING = False  # the sandbox's tools do not import typing at run time
if TYPE_CHECKING:
    from typing import Any

READY_LINE = b"ready\n"
BASH_READY_TIMEOUT_S = 30.0
TOOL_ARGUMENT = {"bash": "command", "ipython": "code"}


class Toolbox:
    """The tools of one sandbox. Bash starts at once; the IPython kernel starts at boot if listed."""

    def __init__(self, workspace: str, env: dict[str, str], tools: list[str]) -> None:
        self.workspace = workspace
        self.env = env
        self.tools = tools
        self._lock = threading.Lock()
        self._bash: Any = None
        self._bash_error: str | None = None
        self._bash_ready = threading.Event()
        self._ipython: Any = None
        self._editor: Any = None
        self.first_answer = threading.Event()
        if "bash" in tools:
            threading.Thread(target=self._start_bash, daemon=True).start()
        if "ipython" in tools:
            from rollout_service.tools.ipython import IPythonSession

            self._ipython = IPythonSession(workspace, env)
            self._ipython.launch()
            threading.Thread(target=self._prewarm_ipython, daemon=True).start()

    def _start_bash(self) -> None:
        try:
            from rollout_service.tools.bash import BashSession

            self._bash = BashSession(self.workspace, self.env)
        except Exception as exc:  # reported on the first bash call
            self._bash_error = f"bash could not start: {exc}"
        self._bash_ready.set()

    def _prewarm_ipython(self) -> None:
        self.first_answer.wait(timeout=5.0)
        try:
            self._ipython.connect()
        except Exception:
            pass  # the first ipython call retries and reports the error

    def handle(self, request: Any) -> dict[str, Any]:
        if not isinstance(request, dict):
            return error_observation("a request must be a JSON object with 'tool' and 'args'")
        tool, args = request.get("tool"), request.get("args")
        if tool == "_ping":
            return observation("pong")
        if not isinstance(args, dict):
            return error_observation(f"the arguments of {tool!r} must be a JSON object")
        if tool not in self.tools:
            return error_observation(f"unknown tool {tool!r}; available tools: {', '.join(self.tools)}")
        timeout_s = float(request.get("timeout_s") or 120.0)
        output_cap = int(request.get("output_cap") or 32 * 1024)
        name = TOOL_ARGUMENT.get(tool)
        if name is not None and not isinstance(args.get(name), str):
            return error_observation(f"{tool} needs a string argument {name!r}")
        with self._lock:
            if tool == "bash":
                return self._run_bash(args["command"], timeout_s, output_cap)
            if tool == "ipython":
                return self._ipython.run(args["code"], timeout_s, output_cap)
            if tool == "editor":
                if self._editor is None:
                    from rollout_service.tools.editor import Editor

                    self._editor = Editor(self.workspace)
                return self._editor.run(args, output_cap)
            if tool == "finish":
                answer = args.get("answer")
                answer = answer if isinstance(answer, str) else json.dumps(answer)
                return observation("", finished=True, answer=answer)
        return error_observation(f"tool {tool!r} is listed but not implemented by this action server")

    def own_pids(self) -> set[int]:
        """The processes the tools started themselves (and wait for)."""
        pids = {
            self._bash.pid if self._bash is not None else None,
            self._ipython.pid if self._ipython is not None else None,
        }
        return {pid for pid in pids if pid is not None}

    def _run_bash(self, command: str, timeout_s: float, output_cap: int) -> dict[str, Any]:
        if not self._bash_ready.wait(BASH_READY_TIMEOUT_S) or self._bash is None:
            return error_observation(self._bash_error or "bash did not start within 30 s")
        return self._bash.run(command, timeout_s, output_cap)


def reap_orphans(toolbox: Toolbox) -> None:
    """A server that is its sandbox's pid 1 inherits every orphaned process: reap those that ended
    (not the tools' own processes, which their tools wait for)."""
    own = toolbox.own_pids()
    for children in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{children}/children") as listing:
                pids = [int(pid) for pid in listing.read().split()]
        except (OSError, ValueError):
            continue
        for pid in pids:
            if pid not in own:
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass


def serve_connection(conn: socket.socket, toolbox: Toolbox) -> None:
    reader = conn.makefile("rb")
    pid_1 = os.getpid() == 1
    with conn, reader:
        for line in reader:
            if pid_1:
                reap_orphans(toolbox)
            try:
                request = json.loads(line)
            except ValueError:
                answer = error_observation("request is not valid JSON")
            else:
                try:
                    answer = toolbox.handle(request)
                except Exception as exc:  # a tool bug must not take the sandbox down
                    answer = error_observation(f"{type(exc).__name__}: {exc}")
            try:
                conn.sendall(json.dumps(answer).encode() + b"\n")
            except OSError:  # the worker went away; the next connection gets the next answer
                return
            toolbox.first_answer.set()


# --option: (default, meaning); parsed without argparse, which slows every sandbox boot
SERVER_OPTIONS: dict[str, tuple[str, str]] = {
    "socket": ("", "pathname of the Unix socket to listen on (required)"),
    "workspace": ("", "working directory of the tools (default: the current directory)"),
    "tools": ("bash,ipython,editor,finish", "comma-separated tools to offer"),
    "memory-mb": ("0", "RLIMIT_AS per process (0: unchanged)"),
    "cpu-time-s": ("0", "RLIMIT_CPU per process (0: unchanged)"),
    "max-procs": ("0", "RLIMIT_NPROC (0: unchanged)"),
    "user": ("", "UID:GID to switch to before serving (when started as root)"),
    "strip-env": ("", "comma-separated variables the tools must not inherit"),
}


def parse_args(argv: list[str]) -> dict[str, str]:
    """``--option value`` pairs of SERVER_OPTIONS; exits with a usage message on anything else."""
    usage = "usage: action_server " + " ".join(f"--{name} {help_!r}" for name, (_, help_) in SERVER_OPTIONS.items())
    options = {name: default for name, (default, _) in SERVER_OPTIONS.items()}
    if len(argv) % 2:
        raise SystemExit(f"every option needs a value: {argv}\n{usage}")
    for flag, value in zip(argv[::2], argv[1::2]):
        name = flag[2:] if flag.startswith("--") else ""
        if name not in options:
            raise SystemExit(f"unknown option {flag!r}\n{usage}")
        options[name] = value
    if not options["socket"]:
        raise SystemExit(f"--socket is required\n{usage}")
    for name in ("memory-mb", "cpu-time-s", "max-procs"):
        if not options[name].isdigit():
            raise SystemExit(f"--{name} must be a whole number, not {options[name]!r}")
    options["workspace"] = options["workspace"] or os.getcwd()
    return options


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    apply_limits(int(args["memory-mb"]), int(args["cpu-time-s"]), int(args["max-procs"]))
    if args["user"]:
        drop_privileges(args["user"])
    os.umask(0o022)
    env = {k: v for k, v in os.environ.items() if k not in set(args["strip-env"].split(","))}
    if os.path.exists(args["socket"]):
        os.unlink(args["socket"])
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(args["socket"])
    os.chmod(args["socket"], 0o600)
    server.listen(8)
    toolbox = Toolbox(args["workspace"], env, [t for t in args["tools"].split(",") if t])
    os.write(1, READY_LINE)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    while True:
        conn, _ = server.accept()
        threading.Thread(target=serve_connection, args=(conn, toolbox), daemon=True).start()


if __name__ == "__main__":
    main()
