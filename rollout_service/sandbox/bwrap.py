"""bubblewrap sandboxes: the host's root read-only, a writable workspace, private /tmp, no network.

Run by an unprivileged worker, bwrap makes a user namespace and everything runs as the worker's
uid. Run by root, bwrap makes no user namespace; the action server starts as root with only
CAP_SETUID/CAP_SETGID, sets its resource limits and switches to a uid leased for this sandbox
alone before it serves anything. That matters because the kernel does not enforce
RLIMIT_NPROC for uid 0, and counts it per uid: one uid per sandbox is what contains a fork bomb.
"""
from __future__ import annotations

import fcntl
import os
import random
import shutil
import stat
import sys
from pathlib import Path
from typing import Any

from rollout_service.errors import SandboxError
from rollout_service.sandbox.base import (
    INNER_SOCKET,
    INNER_SOCKET_DIR,
    INNER_WORKSPACE,
    ServerSandbox,
    SandboxSpec,
    host_import_paths,
    server_arguments,
)
from rollout_service.settings import get_settings

SANDBOX_UID_BASE = 900_000_000
SANDBOX_UID_SLOTS = 65_536
UID_LOCK_DIR = "/run/rollout-sandbox-uids"
PRIVATE_TOP_LEVEL = {"proc", "dev", "tmp", "run", "workspace", "lost+found"}


class UidLease:
    """A uid nobody else uses while this lease (a held ``flock``) lives."""

    def __init__(self, uid: int, fd: int) -> None:
        self.uid = uid
        self._fd = fd

    @classmethod
    def acquire(cls, lock_dir: str = UID_LOCK_DIR) -> "UidLease":
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


def runtime_paths() -> list[str]:
    """Host directories the action server needs: the interpreter, the venv, the package."""
    paths = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix), *host_import_paths()}
    return sorted(paths)


def hidden_ancestor(path: str) -> str | None:
    """The first directory on the way to ``path`` that other users cannot enter, if any."""
    current = Path("/")
    for part in Path(path).parts[1:]:
        current = current / part
        if current.is_dir() and not os.stat(current).st_mode & stat.S_IXOTH:
            return str(current)
    return None


def runtime_mounts(covered: list[str], check_access: bool) -> list[str]:
    """Bind the runtime back at its own path where the sandbox would not see it: under a directory
    the sandbox mounts privately (``covered``: /tmp, ...) or, with ``check_access`` (the server
    switches uid), under a directory other users cannot enter (e.g. /root), hidden by a tmpfs."""
    args: list[str] = []
    made: set[str] = set(covered)
    for path in runtime_paths():
        base = next((c for c in covered if path.startswith(c.rstrip("/") + "/")), None)
        if base is None and check_access:
            base = hidden_ancestor(path)
            if base is not None and base not in made:
                made.add(base)
                args += ["--tmpfs", base]
        if base is None:
            continue
        parent = Path(path).parent
        for directory in reversed([parent, *parent.parents]):
            if len(str(directory)) > len(base) and str(directory) not in made:
                made.add(str(directory))
                args += ["--perms", "0755", "--dir", str(directory)]
        args += ["--ro-bind", path, path]
    return args


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


def bwrap_argv(
    spec: SandboxSpec,
    socket_dir: str,
    env: dict[str, str],
    uid: int | None,
    hide: tuple[str, ...] = (),
) -> list[str]:
    """The bwrap command that runs the action server for ``spec``; ``uid`` set when started as root."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxError("bwrap is not installed: apt-get install bubblewrap, or set ROLLOUT_SANDBOX=singularity (or =local for no isolation, development only)")
    tmp_size = str(max(spec.memory_mb, 64) * 1024 * 1024)
    argv = [bwrap, "--die-with-parent", "--new-session", "--clearenv"]
    if uid is None:
        argv += ["--unshare-all", "--unshare-user", "--disable-userns"]
    else:
        argv += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    argv += host_root_mounts() + ["--dev", "/dev", "--proc", "/proc"]
    for private in ("/tmp", "/dev/shm"):
        argv += ["--perms", "1777", "--size", tmp_size, "--tmpfs", private]
    argv += ["--tmpfs", "/run"]
    covered = ["/tmp", "/dev/shm", "/run"]
    for path in hide:
        if os.path.isdir(path) and not any(path.startswith(c + "/") for c in covered):
            covered.append(path)
            argv += ["--tmpfs", path]
    argv += runtime_mounts(covered, check_access=uid is not None)
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


class BwrapSandbox(ServerSandbox):
    kind = "bwrap"

    def __init__(self, spec: SandboxSpec, redis_client: Any = None) -> None:
        super().__init__(spec, redis_client)
        self._lease: UidLease | None = None

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

    def _launch(self) -> tuple[list[str], dict[str, Any]]:
        assert self.socket_dir is not None
        hide = (str(get_settings().state_path),)
        return bwrap_argv(self.spec, self.socket_dir, self.sandbox_env(), self.uid, hide), {}

    def _release(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None
