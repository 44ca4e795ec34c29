"""bubblewrap sandboxes: the host's root read-only, a writable workspace, private /tmp, no network.

Run by an unprivileged worker, bwrap makes a user namespace and everything runs as the worker's
uid. Run by root, bwrap makes no user namespace; the action server starts as root with only
CAP_SETUID/CAP_SETGID, sets its resource limits and switches to a uid leased for this sandbox
alone before it serves anything. That matters because the kernel does not enforce
RLIMIT_NPROC for uid 0, and counts it per uid: one uid per sandbox is what contains a fork bomb.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import random
import shutil
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from rollout_service.concurrency.green import green_process, wait_ready
from rollout_service.errors import SandboxError
from rollout_service.images import image_cache
from rollout_service.sandbox.base import (
    INNER_SOCKET,
    INNER_SOCKET_DIR,
    INNER_WORKSPACE,
    START_TIMEOUT_S,
    ActionClient,
    SandboxSpec,
    ServerSandbox,
    Spawned,
    _launcher,
    host_import_paths,
    server_arguments,
)
from rollout_service.sandbox.image_root import ImageRoot, check_image_sandbox
from rollout_service.settings import get_settings

SANDBOX_UID_BASE = 900_000_000
SANDBOX_UID_SLOTS = 65_536
UID_LOCK_DIR = "/run/rollout-sandbox-uids"
PRIVATE_TOP_LEVEL = {"proc", "dev", "tmp", "run", "workspace", "lost+found"}
PRIVATE_PER_SANDBOX = ("/tmp", "/dev/shm", "/run")
HOST_VIEW = "/.rollout-host"  # the host's root inside the fork server, for binding workspaces; never in a sandbox
FORK_SERVER_BOOTSTRAP = "import sys; sys.path[:0] = {paths!r}; from rollout_service.tools.zygote import main; main()"
# CAP_KILL: a sandbox's init runs under the sandbox's uid, and the kernel checks the dying server's
# right to signal it before it sends the init its parent-death signal
FORK_SERVER_CAPS = (
    "CAP_SYS_ADMIN",
    "CAP_SETUID",
    "CAP_SETGID",
    "CAP_NET_ADMIN",
    "CAP_DAC_READ_SEARCH",
    "CAP_KILL",
    "CAP_SYS_NICE",  # a booted sandbox back at nice 0 where autogroups are off
    "CAP_DAC_OVERRIDE",  # overlayfs copies a file up with the credentials of who mounted it (an image
    "CAP_CHOWN",  # sandbox's init): these four let it copy any file of the image, its owner and
    "CAP_FOWNER",  # times kept, and make whiteouts; a sandbox's own processes never hold them
    "CAP_MKNOD",
)


class UidLease:
    """A uid nobody else uses while this lease (a held ``flock``) lives."""

    def __init__(self, uid: int, fd: int) -> None:
        self.uid = uid
        self._fd = fd

    @classmethod
    def acquire(cls, lock_dir: str = UID_LOCK_DIR) -> UidLease:
        os.makedirs(lock_dir, mode=0o700, exist_ok=True)
        first = random.randrange(SANDBOX_UID_SLOTS)
        for offset in range(SANDBOX_UID_SLOTS):
            slot = (first + offset) % SANDBOX_UID_SLOTS
            fd = os.open(os.path.join(lock_dir, f"{slot}.lock"), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return cls(SANDBOX_UID_BASE + slot, fd)
        raise SandboxError(f"all {SANDBOX_UID_SLOTS} sandbox uids are in use; stop some sandboxes")

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def give_to(path: str, uid: int) -> None:
    """Make ``path`` and everything under it owned by ``uid`` (and readable by nobody else)."""
    os.lchown(path, uid, uid)
    os.chmod(path, 0o700)
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(root, name)
            if os.lstat(full).st_uid != uid:
                os.lchown(full, uid, uid)


@functools.lru_cache(maxsize=1)
def runtime_paths() -> tuple[str, ...]:
    """Host directories the action server needs: the interpreter, the venv, the package (the same
    for the life of the process; asked at every sandbox start)."""
    paths = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix), *host_import_paths()}
    return tuple(sorted(paths))


@functools.lru_cache(maxsize=1)
def image_runtime_paths() -> tuple[str, ...]:
    """What of the host an image sandbox's action server needs: the interpreter's standard library,
    the ``rollout_service`` package alone (not the directory around it, which may hold the state
    directory) and ptyprocess's site-packages."""
    package = os.path.join(host_import_paths()[0], "rollout_service")
    paths = {os.path.realpath(sys.base_prefix), os.path.realpath(package), *host_import_paths()[1:]}
    return tuple(sorted(paths))


def hidden_ancestor(path: str) -> str | None:
    """The first directory on the way to ``path`` that other users cannot enter, if any."""
    current = Path("/")
    for part in Path(path).parts[1:]:
        current = current / part
        if current.is_dir() and not os.stat(current).st_mode & stat.S_IXOTH:
            return str(current)
    return None


def runtime_rebinds(covered: list[str], check_access: bool) -> list[tuple[str, str]]:
    """Where the sandbox would not see the runtime at its own path: under a directory it mounts
    privately (``covered``: /tmp, ...) or, with ``check_access`` (the server switches uid), under a
    directory other users cannot enter (e.g. /root). In order: ("tmpfs", that directory) to hide it,
    ("dir", d) for each directory to make on the way, ("bind", path) to bind the runtime back."""
    steps: list[tuple[str, str]] = []
    made: set[str] = set(covered)
    for path in runtime_paths():
        base = next((c for c in covered if path.startswith(c.rstrip("/") + "/")), None)
        if base is None and check_access:
            base = hidden_ancestor(path)
            if base is not None and base not in made:
                made.add(base)
                steps.append(("tmpfs", base))
        if base is None:
            continue
        parent = Path(path).parent
        for directory in reversed([parent, *parent.parents]):
            if len(str(directory)) > len(base) and str(directory) not in made:
                made.add(str(directory))
                steps.append(("dir", str(directory)))
        steps.append(("bind", path))
    return steps


def runtime_mounts(covered: list[str], check_access: bool) -> list[str]:
    """``runtime_rebinds`` as bwrap arguments."""
    flags = {"tmpfs": ["--tmpfs"], "dir": ["--perms", "0755", "--dir"]}
    args: list[str] = []
    for step, path in runtime_rebinds(covered, check_access):
        args += [*flags[step], path] if step in flags else ["--ro-bind", path, path]
    return args


def hidden_paths(hide: tuple[str, ...], covered: list[str]) -> list[str]:
    """The directories of ``hide`` that exist and are not under one already covered."""
    hidden: list[str] = []
    for path in hide:
        if os.path.isdir(path) and not any(path.startswith(c + "/") for c in [*covered, *hidden]):
            hidden.append(path)
    return hidden


def host_root_mounts() -> list[str]:
    """The host's top-level directories, read-only, on the sandbox's own root (a tmpfs made
    read-only at the end), so that mount points like /workspace can be created on it."""
    args: list[str] = []
    for name in sorted(os.listdir("/")):
        path = "/" + name
        if name in PRIVATE_TOP_LEVEL:
            continue
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def _bwrap() -> str:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxError(
            "bwrap is not installed: apt-get install bubblewrap, or set ROLLOUT_SANDBOX=singularity (or =local for no isolation, development only)"
        )
    return bwrap


def _layout(tmp_size: str, hide: tuple[str, ...], check_access: bool) -> list[str]:
    """The file system every sandbox sees: the host read-only, private /tmp, /dev/shm and /run."""
    argv = host_root_mounts() + ["--dev", "/dev", "--proc", "/proc"]
    for private in ("/tmp", "/dev/shm"):
        argv += ["--perms", "1777", "--size", tmp_size, "--tmpfs", private]
    argv += ["--tmpfs", "/run"]
    hidden = hidden_paths(hide, list(PRIVATE_PER_SANDBOX))
    for path in hidden:
        argv += ["--tmpfs", path]
    return argv + runtime_mounts([*PRIVATE_PER_SANDBOX, *hidden], check_access=check_access)


def bwrap_argv(
    spec: SandboxSpec,
    socket_dir: str,
    env: dict[str, str],
    uid: int | None,
    hide: tuple[str, ...] = (),
) -> list[str]:
    """The bwrap command that runs the action server for ``spec``; ``uid`` set when started as root."""
    argv = [_bwrap(), "--die-with-parent", "--new-session", "--clearenv"]
    if uid is None:
        argv += ["--unshare-all", "--unshare-user", "--disable-userns"]
    else:
        argv += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    argv += _layout(tmp_size_bytes(spec), hide, check_access=uid is not None)
    argv += read_only_mounts(spec.read_only, [*PRIVATE_PER_SANDBOX, *hidden_paths(hide, list(PRIVATE_PER_SANDBOX))])
    argv += ["--bind", socket_dir, INNER_SOCKET_DIR, "--bind", spec.workspace, INNER_WORKSPACE]
    argv += ["--chdir", INNER_WORKSPACE]
    argv += ["--remount-ro", "/", "--hostname", "sandbox"]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    argv += ["--", sys.executable]
    argv += server_arguments(spec, INNER_SOCKET, INNER_WORKSPACE, host_import_paths())
    if uid is not None:
        argv += ["--user", f"{uid}:{uid}"]
    return argv


def read_only_mounts(paths: tuple[str, ...], covered: list[str]) -> list[str]:
    """``paths`` bound read-only at their own paths; where one lies under a directory the sandbox
    mounts privately, the directories on the way are made enterable first."""
    args: list[str] = []
    for path in paths:
        base = next((c for c in covered if path.startswith(c.rstrip("/") + "/")), None)
        if base is not None:
            parent = Path(path).parent
            for directory in reversed([parent, *parent.parents]):
                if len(str(directory)) > len(base):
                    args += ["--perms", "0755", "--dir", str(directory)]
        args += ["--ro-bind", path, path]
    return args


def tmp_size_bytes(spec: SandboxSpec) -> str:
    return str(max(spec.memory_mb, 64) * 1024 * 1024)


def fork_server_argv(control_fd: int) -> list[str]:
    """The bwrap command of the fork server (``rollout_service.tools.zygote``): the sandboxes' layout
    (their own /tmp, /dev/shm, /run, /proc and /dev/pts are mounted per sandbox), no network, the host's
    root at HOST_VIEW to bind workspaces from, and the capabilities to make namespaces and mounts."""
    argv = [
        _bwrap(),
        "--die-with-parent",
        "--new-session",
        "--clearenv",
        "--unshare-ipc",
        "--unshare-net",
        "--unshare-uts",
        "--unshare-cgroup-try",
    ]
    argv += ["--cap-drop", "ALL"]
    for capability in FORK_SERVER_CAPS:
        argv += ["--cap-add", capability]
    argv += _layout("1048576", (), check_access=True)
    argv += ["--dir", INNER_WORKSPACE, "--bind", "/", HOST_VIEW, "--remount-ro", "/", "--hostname", "sandbox"]
    boot_niceness = min(max(get_settings().sandbox_boot_niceness, 0), 19)
    argv += [
        "--",
        sys.executable,
        "-I",
        "-S",
        "-c",
        FORK_SERVER_BOOTSTRAP.format(paths=host_import_paths()),
        "--control-fd",
        str(control_fd),
        "--boot-niceness",
        str(boot_niceness),
    ]
    return argv


def fork_mount_plan(spec: SandboxSpec, socket_dir: str, hide: tuple[str, ...]) -> list[list[str]]:
    """What a forked sandbox's init mounts (``rollout_service.tools.zygote.apply_mounts``) to get what
    a sandbox of its own bwrap gets: a fresh /tmp, /dev/shm and /run (with the runtime bound back where
    it lives under them), an empty directory over each of ``hide``, its workspace and socket directory,
    its own /proc and /dev/pts; then the host's root is detached."""
    size = tmp_size_bytes(spec)
    plan: list[list[str]] = [
        ["private", "/"],
        ["tmpfs", size, "1777", "/tmp"],
        ["tmpfs", size, "1777", "/dev/shm"],
        ["tmpfs", "1048576", "755", "/run"],
    ]
    for step, path in runtime_rebinds(list(PRIVATE_PER_SANDBOX), check_access=False):
        plan += [["dir", path]] if step == "dir" else [["dir", path], ["ro-bind", HOST_VIEW + path, path]]
    for path in hidden_paths(hide, list(PRIVATE_PER_SANDBOX)):
        plan.append(["tmpfs", "4096", "755", path])
    for path in spec.read_only:
        plan += [["dir", path], ["ro-bind", HOST_VIEW + os.path.realpath(path), path]]
    plan += [
        ["dir", INNER_SOCKET_DIR],
        ["bind", HOST_VIEW + os.path.realpath(socket_dir), INNER_SOCKET_DIR],
        ["bind", HOST_VIEW + os.path.realpath(spec.workspace), INNER_WORKSPACE],
        ["proc", "/proc"],
        ["devpts", "/dev/pts"],
        ["detach", HOST_VIEW],
    ]
    return plan


class ForkServer:
    """This process's fork server: started on first use, started again if it died."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner = -1
        self._control: socket.socket | None = None
        self._process: Any = None
        self._log = ""

    def warm(self) -> None:
        """Start this process's server ahead of its first sandbox, so that its cold start is not
        paid by the first grading of an eval child."""
        with self._lock:
            self._connected()

    def spawn(self, request: dict[str, Any], fds: list[int]) -> int:
        """Fork a sandbox for ``request`` with ``fds`` (channel, log, status); returns its pid."""
        with self._lock:
            answer = b""
            for _ in range(2):  # a dead server took its sandboxes with it, so one retry is safe
                try:
                    control = self._connected()
                    socket.send_fds(control, [json.dumps(request).encode()], fds)
                    answer = control.recv(65536)
                except OSError:
                    answer = b""
                if answer:
                    break
                self._discard()
        if not answer:
            raise SandboxError(f"the sandbox fork server stopped answering; {self._log_tail()}")
        reply = json.loads(answer)
        if "error" in reply:
            raise SandboxError(f"the sandbox fork server could not start a sandbox: {reply['error']}")
        return int(reply["pid"])

    def _connected(self) -> socket.socket:
        if self._control is not None and self._owner == os.getpid():
            return self._control
        self._control = None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._log = os.path.join(log_dir(), f"fork-server-{os.getpid()}.log")
        try:
            os.set_inheritable(theirs.fileno(), True)
            argv = fork_server_argv(theirs.fileno())
            with open(self._log, "wb") as log:
                if green_process():
                    self._process = Spawned(argv, log)
                else:
                    self._process = _launcher.popen(
                        argv,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=log,
                        start_new_session=True,
                        pass_fds=(theirs.fileno(),),
                    )
        finally:
            theirs.close()
        fd = self._process.stdout.fileno()
        if not wait_ready(fd, START_TIMEOUT_S) or os.read(fd, 64) != b"ready\n":
            self._discard()
            raise SandboxError(f"the sandbox fork server did not start; {self._log_tail()}")
        self._control, self._owner = ours, os.getpid()
        return ours

    def _discard(self) -> None:
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._process is not None and self._owner == os.getpid():
            try:
                os.kill(self._process.pid, 9)
            except OSError:
                pass
            self._process.wait()
            self._process.stdout.close()
        self._process = None

    def _log_tail(self) -> str:
        try:
            with open(self._log, "rb") as f:
                return "its log: " + f.read()[-2000:].decode("utf-8", "replace")
        except OSError:
            return "no log"


def log_dir() -> str:
    """Where fork servers log: the service's log directory (``rollout-service up`` makes it), else /tmp."""
    logs = get_settings().state_path / "logs"
    if logs.is_dir():
        return str(logs)
    import tempfile

    return tempfile.gettempdir()


_fork_server = ForkServer()


class Forked:
    """A sandbox the fork server started: ``pid`` is its init (P1), as seen from this pid namespace;
    its init writes the exit code of the server or script to ``status_fd`` and closes it."""

    def __init__(self, pid: int, status_fd: int, stdout: Any = None) -> None:
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._status = status_fd
        self._reading = threading.Lock()  # one reader at a time: the status pipe is closed once read

    def poll(self) -> int | None:
        if self.returncode is None and self._reading.acquire(blocking=False):
            try:
                if self.returncode is None and wait_ready(self._status, 0):
                    self._collect()
            finally:
                self._reading.release()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._reading.acquire(timeout=-1 if timeout is None else timeout):
            raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
        try:
            code = self.returncode
            if code is None:
                if not wait_ready(self._status, timeout):
                    raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
                code = self._collect()
        finally:
            self._reading.release()
        return code

    def _collect(self) -> int:
        data = b""
        while chunk := os.read(self._status, 64):
            data += chunk
        os.close(self._status)
        self.returncode = int(data) if data.strip() else -9  # no code: its init was killed
        return self.returncode


def use_fork_server() -> bool:
    return get_settings().sandbox_fork_server and os.geteuid() == 0


def warm_fork_server() -> None:
    """Start this process's fork server now if its sandboxes will come from one (else nothing)."""
    if get_settings().sandbox == "bwrap" and use_fork_server():
        _fork_server.warm()


class BwrapSandbox(ServerSandbox):
    kind = "bwrap"

    def __init__(self, spec: SandboxSpec, redis_client: Any = None) -> None:
        super().__init__(spec, redis_client)
        self._lease: UidLease | None = None
        self._image: ImageRoot | None = None

    @property
    def uid(self) -> int | None:
        return self._lease.uid if self._lease else None

    def _prepare(self) -> None:
        if os.geteuid() != 0:
            return
        self._lease = UidLease.acquire()
        assert self.socket_dir is not None
        give_to(self.socket_dir, self._lease.uid)
        give_to(self.spec.workspace, self._lease.uid)

    def _spawn(self) -> None:
        check_image_sandbox(self.spec, use_fork_server())
        if not use_fork_server():
            return super()._spawn()
        self._make_socket_dir()
        self._prepare()
        assert self._lease is not None
        spec = self.spec
        request = {
            "mounts": fork_mount_plan(spec, self.socket_dir or "", self.hidden()),
            "env": self.sandbox_env(),
            "tools": list(spec.tools),
            "memory_mb": spec.memory_mb,
            "cpu_time_s": spec.cpu_time_s,
            "max_procs": spec.max_procs,
            "user": f"{self._lease.uid}:{self._lease.uid}",
            "workspace": spec.workdir or INNER_WORKSPACE,
            "script": list(spec.script),
        }
        if spec.image is not None:
            self._image = image = ImageRoot.prepare(spec, self.sandbox_id)
            os.chown(
                image.scratch / "upper", self._lease.uid, self._lease.uid
            )  # its root is the sandbox's, as / is root's
            request["mounts"] = image.mount_plan(spec, self.socket_dir or "", HOST_VIEW, image_runtime_paths())
            request["env"] = image.env(self.sandbox_env(), spec.env)
            request["workspace"] = image.workdir(spec)
            request["idmap"] = True
            with image_cache().start_slot(image.rootfs.digest):
                self._fork(request)
            return
        self._fork(request)

    def _fork(self, request: dict[str, Any]) -> None:
        spec = self.spec
        status_read, status_write = os.pipe()
        if spec.script:
            ours, channel = os.pipe()
            stdout: Any = os.fdopen(ours, "rb", buffering=0)
        else:
            ours_socket, theirs = socket.socketpair()
            channel, stdout = theirs.detach(), None
        try:
            with open(self._log_path or "", "ab") as log:
                pid = _fork_server.spawn(request, [channel, log.fileno(), status_write])
        except BaseException:
            os.close(status_read)
            if stdout is not None:
                stdout.close()
            else:
                ours_socket.close()
            raise
        finally:
            os.close(channel)
            os.close(status_write)
        self.process = Forked(pid, status_read, stdout)
        self.process_is_namespace_init = True
        if not spec.script:
            self._client = ActionClient.over(ours_socket)

    def _launch(self) -> tuple[list[str], dict[str, Any]]:
        assert self.socket_dir is not None
        return bwrap_argv(self.spec, self.socket_dir, self.sandbox_env(), self.uid, self.hidden()), {}

    @staticmethod
    def hidden() -> tuple[str, ...]:
        """What a sandbox must not see of the host: the service's state (Redis files, ground truth)."""
        return (str(get_settings().state_path),)

    def _release(self) -> None:
        if self._image is not None:
            self._image.release()
            self._image = None
        if self._lease is not None:
            self._lease.release()
            self._lease = None
