"""What every sandbox kind shares: the spec, the interface, the socket client and the
start/execute/stop lifecycle of an action server child process."""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rollout_service.concurrency.green import green_process, in_background, wait_ready
from rollout_service.errors import STORE_OUTAGE, SandboxError
from rollout_service.sandbox.processes import (
    kill_tree,
    make_scratch_dir,
)
from rollout_service.settings import get_settings

log = logging.getLogger(__name__)

SOCKET_NAME = "action.sock"
INNER_SOCKET_DIR = "/run/rollout"
INNER_SOCKET = f"{INNER_SOCKET_DIR}/{SOCKET_NAME}"
INNER_WORKSPACE = "/workspace"
START_TIMEOUT_S = 60.0
CALL_GRACE_S = 30.0
MAX_SOCKET_PATH = 107
BOOTSTRAP = "import sys; sys.path[:0] = {paths!r}; from rollout_service.tools.action_server import main; main()"
SCRIPT_BOOTSTRAP = (
    "import sys; sys.path[:0] = {paths!r}; from rollout_service.tools.confine import run_script; run_script()"
)
MAX_SCRIPT_OUTPUT_BYTES = 4 * 1024 * 1024


@dataclass
class SandboxSpec:
    job_id: str
    workspace: str
    image: str | None = None
    tools: tuple[str, ...] = ("bash", "ipython", "editor", "finish")
    memory_mb: int = 2048
    cpu_time_s: int = 3600
    max_procs: int = 256
    ttl_s: float = 7200
    env: dict[str, str] = field(default_factory=dict)
    script: tuple[str, ...] = ()  # a one-shot sandbox (``run``): this script and its arguments, no tools
    read_only: tuple[str, ...] = ()  # host directories bound read-only at their own paths (a harness's env_dir)
    workdir: str = ""  # the tools' working directory inside ("": the image's WorkingDir, else /workspace)
    pin_repo: tuple[str, ...] = ()  # (repo_dir, commit): the image's repository holds nothing after commit


class Sandbox(Protocol):
    sandbox_id: str
    boot_s: float | None

    def start(self) -> None: ...

    def execute(self, tool: str, args: dict, timeout_s: float) -> dict: ...

    def run(self, timeout_s: float) -> tuple[int | None, str]: ...

    def stop(self) -> None: ...


class ActionClient:
    """One persistent connection to an action server; newline-delimited JSON each way."""

    def __init__(self, path: str, connected: socket.socket | None = None) -> None:
        self.path = path
        if connected is None:
            connected = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            connected.connect(path)
        self._sock = connected
        self._reader = self._sock.makefile("rb")
        self._lock = threading.Lock()

    @classmethod
    def over(cls, connected: socket.socket) -> ActionClient:
        """A client on a socket already connected to the server (a socketpair's end)."""
        return cls("", connected)

    def call(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        with self._lock:
            self._sock.settimeout(timeout_s)
            self._sock.sendall(json.dumps(request).encode() + b"\n")
            line = self._reader.readline()
        if not line:
            raise ConnectionError("the action server closed the connection")
        return json.loads(line)

    def close(self) -> None:
        self._reader.close()
        self._sock.close()


_turns: dict[int, threading.BoundedSemaphore] = {}


def _stop_turns() -> threading.BoundedSemaphore:
    """This process's turns to stop a sandbox in the background (made after a fork, and after
    gevent's patching in a green worker)."""
    turns = _turns.get(os.getpid())
    if turns is None:
        turns = _turns.setdefault(
            os.getpid(), threading.BoundedSemaphore(max(get_settings().sandbox_concurrent_stops, 1))
        )
    return turns


class BackgroundStart:
    """A sandbox starting in a thread of its own while the episode goes on (its first step is an
    LLM call, which does not need it): a tool call waits for the start, and raises its error."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox
        self.waited_s = 0.0
        self._error: BaseException | None = None
        self._started = threading.Event()
        in_background(self._start, name=f"start-{sandbox.sandbox_id}")

    def _start(self) -> None:
        try:
            self.sandbox.start()
        except BaseException as exc:
            self._error = exc
        finally:
            self._started.set()

    def ready(self) -> Sandbox:
        """The sandbox once started (waiting for it, and counting the wait)."""
        if not self._started.is_set():
            began = time.monotonic()
            self._started.wait()
            self.waited_s += time.monotonic() - began
        if self._error is not None:
            raise self._error
        return self.sandbox

    def execute(self, tool: str, args: dict, timeout_s: float) -> dict:
        return self.ready().execute(tool, args, timeout_s)

    @property
    def boot_s(self) -> float | None:
        """How long the start took (None if it failed), once it is over."""
        self._started.wait()
        return self.sandbox.boot_s

    def stop(self) -> None:
        self._started.wait()
        self.sandbox.stop()

    def stop_soon(self) -> None:
        """Stop in a thread of its own: a torn-down sandbox's processes take a while to die under
        load, and nothing needs to wait for it. Its uid goes back to the pool only once they are
        dead; the reaper covers a crash. At most ``sandbox_concurrent_stops`` at once per process,
        the others in turn, so that the many sandboxes torn down together at the end of a step
        leave the CPU to the last turns of the episodes still running."""
        in_background(self._stop_in_turn, name=f"stop-{self.sandbox.sandbox_id}")

    def _stop_in_turn(self) -> None:
        with _stop_turns():
            self.stop()


def package_root() -> str:
    """The directory that holds the ``rollout_service`` package (the action server imports it)."""
    return str(Path(__file__).resolve().parents[2])


def host_import_paths() -> list[str]:
    """What the action server imports from this host's Python: the package, and ptyprocess's
    site-packages directory (named, so the server starts without running ``site``)."""
    import ptyprocess

    return list(dict.fromkeys([package_root(), str(Path(ptyprocess.__file__).resolve().parents[1])]))


def server_arguments(
    spec: SandboxSpec, socket_path: str, workspace: str, import_paths: list[str], run_site: bool = False
) -> list[str]:
    """Python arguments that start the action server with ``import_paths`` first on sys.path.

    ``-I``: the workspace (the current directory) is never on sys.path, so a file there cannot
    shadow a module of the server. Without ``run_site`` (``-S``) start-up skips site-packages'
    .pth processing, paid at every boot otherwise. A spec with a ``script``
    runs that script, confined the same way, instead of the server."""
    flags = ["-I", *([] if run_site else ["-S"])]
    limits = [
        "--workspace",
        workspace,
        "--memory-mb",
        str(spec.memory_mb),
        "--cpu-time-s",
        str(spec.cpu_time_s),
        "--max-procs",
        str(spec.max_procs),
    ]
    if spec.script:
        return [
            *flags,
            "-c",
            SCRIPT_BOOTSTRAP.format(paths=list(import_paths)),
            *limits,
            *(part for arg in spec.script for part in ("--argv", arg)),
        ]
    return [
        *flags,
        "-c", BOOTSTRAP.format(paths=list(import_paths)),
        "--socket", socket_path,
        "--workspace", workspace,
        "--tools", ",".join(spec.tools),
        "--memory-mb", str(spec.memory_mb),
        "--cpu-time-s", str(spec.cpu_time_s),
        "--max-procs", str(spec.max_procs),
    ]  # fmt: skip


_held: dict[str, ServerSandbox] = {}  # started by this process (a forked child inherits, but does not own, them)


@atexit.register
def stop_held_sandboxes() -> None:
    """Stop what this process still holds as it exits (a worker's warm shutdown with stops waiting their
    turn in the background): their processes would die with it, but their directories and records stay.
    A process that is killed leaves that to the reaper."""
    for sandbox in [held for held in _held.values() if held.owner_pid == os.getpid()]:
        try:
            sandbox.stop()
        except Exception:
            log.warning("sandbox %s: could not stop it at exit", sandbox.sandbox_id, exc_info=True)


class _Launcher:
    """Forks sandbox processes from one long-lived thread. ``bwrap --die-with-parent`` uses
    PR_SET_PDEATHSIG, which fires when the *thread* that forked it exits: a sandbox started
    from a short-lived thread (a recycled pool thread, a helper) would die with that thread."""

    def __init__(self) -> None:
        self._requests: queue.Queue = queue.Queue()
        self._pid = -1
        self._lock = threading.Lock()

    def popen(self, argv: list[str], **options: Any) -> subprocess.Popen:
        with self._lock:
            if self._pid != os.getpid():  # first use, or first use after a fork
                self._requests = queue.Queue()
                thread = threading.Thread(target=self._serve, args=(self._requests,), daemon=True)
                thread.start()
                self._pid = os.getpid()
        result: Future = Future()
        self._requests.put((argv, options, result))
        return result.result()

    @staticmethod
    def _serve(requests: queue.Queue) -> None:
        while True:
            argv, options, result = requests.get()
            try:
                result.set_result(subprocess.Popen(argv, **options))
            except BaseException as exc:
                result.set_exception(exc)


_launcher = _Launcher()


class Spawned:
    """A sandbox process started with ``os.posix_spawn`` (glibc spawns with vfork), for green
    workers: gevent's Popen forks the whole worker, which costs CPU in proportion to the worker's
    memory, plus copy-on-write faults after. All greenlets run on the main thread, which lives
    as long as the process, so ``--die-with-parent`` holds. stdin is /dev/null, stdout a pipe."""

    def __init__(self, argv: list[str], stderr: Any) -> None:
        read_end, write_end = os.pipe()
        try:
            self.pid = os.posix_spawnp(
                argv[0],
                argv,
                dict(os.environ),
                setsid=True,
                file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                    (os.POSIX_SPAWN_DUP2, write_end, 1),
                    (os.POSIX_SPAWN_DUP2, stderr.fileno(), 2),
                ],
            )
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        self.stdout = os.fdopen(read_end, "rb", buffering=0)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by gevent's child watcher: the status is gone
                pid, status = self.pid, 0
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            time.sleep(0.005)
        return code


class SandboxProcess(Protocol):
    """A sandbox's top process: a ``subprocess.Popen``, a ``Spawned`` or a fork server's ``Forked``."""

    @property
    def pid(self) -> int: ...

    @property
    def stdout(self) -> Any: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class ServerSandbox:
    """A sandbox whose action server is a child process listening on ``<socket_dir>/action.sock``.

    Subclasses say how to launch it (``_launch``) and may prepare or release resources.
    """

    kind = ""

    def __init__(self, spec: SandboxSpec, redis_client: Any = None) -> None:
        self.spec = spec
        self.redis = redis_client
        self.sandbox_id = uuid.uuid4().hex[:16]
        self.socket_dir: str | None = None
        self.boot_s: float | None = None
        self.process: SandboxProcess | None = None
        self.process_is_namespace_init = False  # killing it kills every process of the sandbox
        self._client: ActionClient | None = None
        self._stopped = False
        self._stop_lock = threading.RLock()
        self.owner_pid = os.getpid()
        self._log_path: str | None = None

    @property
    def socket_path(self) -> str:
        assert self.socket_dir is not None
        return os.path.join(self.socket_dir, SOCKET_NAME)

    def start(self) -> None:
        if self.process is not None:
            raise SandboxError(f"sandbox {self.sandbox_id} was already started; create a new one")
        began = time.monotonic()
        if not os.path.isdir(self.spec.workspace):
            raise SandboxError(
                f"workspace {self.spec.workspace!r} does not exist; the init stage must create it before start()"
            )
        try:
            self._spawn()
            self._register()
            if self._client is None:
                self._wait_ready(began + START_TIMEOUT_S)
                self._client = ActionClient(self.socket_path)
            self._client.call({"tool": "_ping", "args": {}}, START_TIMEOUT_S)
        except SandboxError:
            self.stop()
            raise
        except (OSError, ValueError) as exc:
            message = f"{self.kind} sandbox failed to start: {exc}; {self._log_tail()}"
            self.stop()
            raise SandboxError(message) from exc
        except BaseException:
            self.stop()
            raise
        self.boot_s = time.monotonic() - began

    def _register(self) -> None:
        """Registered as soon as its process exists: a worker that dies while it boots leaves a record
        for the reaper, not an unknown process."""
        if self.redis is None:
            return
        from rollout_service.sandbox.registry import register

        try:
            register(self.redis, self)
        except STORE_OUTAGE:  # the state store is away: the job waits for another delivery, it did not fail
            raise
        except Exception as exc:  # an unregistered sandbox could outlive its worker unseen
            raise SandboxError(
                f"could not register sandbox {self.sandbox_id} in Redis ({exc}); check that Redis is reachable"
            ) from exc

    def run(self, timeout_s: float) -> tuple[int | None, str]:
        """A one-shot sandbox: run ``spec.script`` to its end (killed after ``timeout_s``) and stop.
        Returns (exit code, None when it was killed; its stdout then stderr, each capped)."""
        if not self.spec.script:
            raise SandboxError("run() needs a SandboxSpec with a script; start() serves tools instead")
        if self.process is not None:
            raise SandboxError(f"sandbox {self.sandbox_id} was already started; create a new one")
        try:
            self._spawn()
            self._register()
            output, finished = self._read_to_end(time.monotonic() + timeout_s)
            try:
                exit_code = self._started_process().wait(timeout=10) if finished else None
            except subprocess.TimeoutExpired:  # its output closed, yet it runs on: stop() kills it
                exit_code = None
            with open(self._log_path or "", "rb") as log_file:
                errors = log_file.read(MAX_SCRIPT_OUTPUT_BYTES)
        except OSError as exc:
            raise SandboxError(
                f"{self.kind} sandbox failed to run {self.spec.script[0]}: {exc}; {self._log_tail()}"
            ) from exc
        finally:
            self.stop()
        return exit_code, output.decode("utf-8", "replace") + errors.decode("utf-8", "replace")

    def _spawn(self) -> None:
        """Make the socket directory, take what this kind needs, start the sandbox's process."""
        self._make_socket_dir()
        self._prepare()
        argv, popen_options = self._launch()
        with open(self._log_path or "", "ab") as log_file:
            if green_process() and not popen_options:
                self.process = Spawned(argv, log_file)
            else:
                self.process = _launcher.popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=log_file,
                    start_new_session=True,
                    **popen_options,
                )

    def _started_process(self) -> SandboxProcess:
        if self.process is None:
            raise SandboxError(f"sandbox {self.sandbox_id} has no process; call start() or run() first")
        return self.process

    def _make_socket_dir(self) -> None:
        self.owner_pid = os.getpid()
        _held[self.sandbox_id] = self
        self.socket_dir = make_scratch_dir(self.sandbox_id[:8])
        if not self.spec.script and len(self.socket_path) > MAX_SOCKET_PATH:
            raise SandboxError(
                f"socket path {self.socket_path!r} is longer than a Unix socket allows (107 bytes); "
                "point ROLLOUT_SANDBOX_SCRATCH_DIR at a shorter directory"
            )
        self._log_path = os.path.join(self.socket_dir, "server.log")

    def _read_to_end(self, deadline: float) -> tuple[bytes, bool]:
        """The process's stdout (capped), and whether it closed before ``deadline``."""
        assert self.process is not None and self.process.stdout is not None
        fd, size = self.process.stdout.fileno(), 0
        chunks: list[bytes] = []
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not wait_ready(fd, remaining):
                return b"".join(chunks), False
            chunk = os.read(fd, 65536)
            if not chunk:
                return b"".join(chunks), True
            if size < MAX_SCRIPT_OUTPUT_BYTES:
                chunks.append(chunk[: MAX_SCRIPT_OUTPUT_BYTES - size])
                size += len(chunks[-1])

    def execute(self, tool: str, args: dict, timeout_s: float) -> dict:
        if self._client is None:
            raise SandboxError(f"sandbox {self.sandbox_id} is not running; call start() first")
        settings = get_settings()
        tool_timeout_s = float(timeout_s) if timeout_s and timeout_s > 0 else settings.tool_timeout_s
        request = {
            "tool": tool,
            "args": args,
            "timeout_s": tool_timeout_s,
            "output_cap": settings.tool_output_cap_bytes,
        }
        try:
            return self._client.call(request, tool_timeout_s + CALL_GRACE_S)
        except (OSError, ValueError) as exc:
            raise SandboxError(
                f"the action server of {self.kind} sandbox {self.sandbox_id} stopped answering ({exc}); "
                f"the sandbox is unusable: stop it and start a new one. {self._log_tail()}"
            ) from exc

    def stop(self) -> None:
        """Kill its processes, unregister it, remove its directory. A second caller waits for the first."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
            try:
                self._stop()
            finally:
                _held.pop(self.sandbox_id, None)

    def _stop(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except OSError:
                pass
            self._client = None
        if self.process is not None:
            kill_tree(self.process.pid, get_settings().sandbox_stop_niceness, self.process_is_namespace_init)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.error("sandbox %s: process %s did not die after SIGKILL", self.sandbox_id, self.process.pid)
            if self.process.stdout is not None:
                self.process.stdout.close()
        if self.redis is not None:
            from rollout_service.sandbox.registry import unregister

            try:
                unregister(self.redis, self.sandbox_id)
            except Exception as exc:  # the reaper cleans up what could not be unregistered
                log.warning("sandbox %s: could not unregister: %s", self.sandbox_id, exc)
        self._release()
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)

    def inside(self) -> tuple[str, str, str]:
        """(python, directory holding ``rollout_service``, socket directory) as seen inside the sandbox."""
        return sys.executable, package_root(), INNER_SOCKET_DIR

    def _prepare(self) -> None:
        """Get resources ready before launch (uids, images)."""

    def _launch(self) -> tuple[list[str], dict[str, Any]]:
        raise NotImplementedError

    def _release(self) -> None:
        """Give back what ``_prepare`` took."""

    def _wait_ready(self, deadline: float) -> None:
        assert self.process is not None and self.process.stdout is not None
        fd = self.process.stdout.fileno()
        line = b""
        while not line.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not wait_ready(fd, remaining):
                raise SandboxError(
                    f"{self.kind} sandbox did not become ready within {START_TIMEOUT_S:g} s; {self._log_tail()}"
                )
            chunk = os.read(fd, 64)
            if not chunk:
                self.process.wait()
                raise SandboxError(
                    f"{self.kind} sandbox exited with code {self.process.returncode} before it was ready; "
                    f"{self._log_tail()}"
                )
            line += chunk
        if line != b"ready\n":
            raise SandboxError(f"{self.kind} sandbox printed {line!r} instead of 'ready'; {self._log_tail()}")

    def _log_tail(self) -> str:
        try:
            with open(self._log_path or "", "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 2000))
                text = f.read().decode("utf-8", "replace").strip()
        except OSError:
            return "no server log"
        return f"server log: {text}" if text else "the server log is empty"

    def sandbox_env(self) -> dict[str, str]:
        """What the tools see: a clean environment plus ``spec.env``; nothing of the worker's."""
        path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        env = {
            "PATH": f"{path}:{os.path.dirname(sys.executable)}",
            "HOME": "/tmp",
            "USER": "sandbox",
            "LOGNAME": "sandbox",
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            "ROLLOUT_WORKSPACE": INNER_WORKSPACE,
        }
        env.update(self.spec.env)
        return env

    def __enter__(self) -> ServerSandbox:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
