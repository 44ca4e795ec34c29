"""The sandbox fork server: one per worker process, itself inside bubblewrap, that forks sandboxes.

Booting a sandbox as its own ``bwrap`` + Python costs CPU for bwrap's mounts, a Python start and
the server's imports, and a grader as much again. This process pays that once: it runs in
one bwrap (the host read-only, no network, its own /tmp), has the action server and the grader's
modules imported, and for each request forks:

    P1  (pid 1)      its child, born in a new pid namespace: dies with this server, unshares
                     mount/net/ipc/uts namespaces, mounts a fresh /tmp, /dev/shm, /run, /proc and
                     /dev/pts, binds the workspace and the socket directory, brings loopback up,
                     all at this server's lowered priority (``--boot-niceness``: a wave of boots
                     yields to the workers starting episodes); then setsid (its own priority
                     again), limits, switches to the sandbox's own uid (all capabilities go) and
                     serves the tools on the socket it was handed (reaping the orphans a pid 1
                     inherits), or runs a one-shot Python script or module
    P2               for a one-shot program only: confined the same way, it execs the program
                     while P1 reaps

Killing P1 ends the sandbox: when P1 dies, the kernel kills everything in its pid namespace.
Agent code never runs in this process's image (bash and the IPython kernel are exec'd). Graded
code does: it runs in a child the grader forks. What it could find there of other sandboxes is
what passes through this server: spawn requests (mount plans with workspace and socket paths,
limits, uids, the fixed sandbox environment); no secret does (a harness's key goes to its own
sandbox's server, over that sandbox's socket).

Requests come on a SOCK_SEQPACKET socket (``--control-fd``): one JSON object and three file descriptors
(the channel: a socket to serve or the script's stdout; a log for stderr; a pipe P1 writes
P2's exit code to). The answer is ``{"pid": P1}`` or ``{"error": ...}``. Run as root only.
"""

from __future__ import annotations

import ctypes
import fcntl
import gc
import json
import os
import runpy  # noqa: F401  (what sandboxes use, imported once here instead of in every sandbox)
import select  # noqa: F401
import signal
import socket
import struct
import subprocess  # noqa: F401
import sys
import traceback

from rollout_service.concurrency.priority import lower_priority, restore_priority
from rollout_service.tools import action_server, bash, code_runner, confine  # noqa: F401

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS = 0x00020000, 0x02000000, 0x04000000
CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x08000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
CLONE_NEWUSER = 0x10000000
AT_FDCWD, AT_EMPTY_PATH, AT_RECURSIVE = -100, 0x1000, 0x8000
OPEN_TREE_CLONE, OPEN_TREE_CLOEXEC, MOUNT_ATTR_IDMAP, MOVE_MOUNT_F_EMPTY_PATH = 1, 0o2000000, 0x100000, 4
SYS_OPEN_TREE, SYS_MOVE_MOUNT, SYS_MOUNT_SETATTR = 428, 429, 442  # the same number on every architecture
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(os.uname().machine, 155)
PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
MAX_REQUEST_BYTES = 1 << 20
MAX_FD = 1 << 20

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]  # fmt: skip


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encode = lambda text: text.encode() if text is not None else None  # noqa: E731
    _check(_libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)), f"mount {target}")


def _die_with_parent() -> None:
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")


def _syscall(number: int, *args: object) -> int:
    result = _libc.syscall(number, *args)
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"syscall {number}: {os.strerror(errno)}")
    return int(result)


def idmapped_bind(source: str, target: str, userns: int) -> None:
    """Bind ``source`` at ``target`` with its owners mapped through ``userns`` (an image's files,
    owned by root on disk, then belong to the sandbox's uid: it may change them, as root may in a
    container, while the kernel still counts its processes against its own uid)."""
    tree = _syscall(SYS_OPEN_TREE, AT_FDCWD, source.encode(), OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE)
    try:
        attr = _MountAttr(MOUNT_ATTR_IDMAP, 0, 0, userns)
        _syscall(SYS_MOUNT_SETATTR, tree, b"", AT_EMPTY_PATH | AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr))
        _syscall(SYS_MOVE_MOUNT, tree, b"", AT_FDCWD, target.encode(), MOVE_MOUNT_F_EMPTY_PATH)
    finally:
        os.close(tree)


def enter_root(new_root: str) -> None:
    """Make ``new_root`` this mount namespace's root, and drop the old one entirely."""
    old = os.path.join(new_root, ".rollout-old-root")
    os.makedirs(old, exist_ok=True)
    _syscall(SYS_PIVOT_ROOT, new_root.encode(), old.encode())
    os.chdir("/")
    _check(_libc.umount2(b"/.rollout-old-root", MNT_DETACH), "umount the old root")
    os.rmdir("/.rollout-old-root")


def mapping_namespace(user: str) -> int:
    """A user namespace mapping root to ``user`` ("uid:gid"), as a file descriptor: a child makes
    it, this process (in the host's pid namespace, with CAP_SETUID) writes its maps."""
    uid, gid = user.split(":")
    ready_read, ready_write = os.pipe()
    hold_read, hold_write = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.close(ready_read)
            os.close(hold_write)
            _check(_libc.unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
            os.write(ready_write, b"1")
            os.read(hold_read, 1)
        finally:
            os._exit(0)
    os.close(ready_write)
    os.close(hold_read)
    try:
        if os.read(ready_read, 1) != b"1":
            raise OSError("the user namespace helper failed")
        with open(f"/proc/{child}/uid_map", "w") as uid_map:
            uid_map.write(f"0 {uid} 1\n")
        with open(f"/proc/{child}/gid_map", "w") as gid_map:
            gid_map.write(f"0 {gid} 1\n")
        return os.open(f"/proc/{child}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(ready_read)
        os.close(hold_write)
        try:
            os.waitpid(child, 0)
        except ChildProcessError:  # reaped by the SIGCHLD handler already
            pass


def apply_mounts(operations: list, userns: int = -1) -> None:
    """Run the mount plan the worker computed (``rollout_service.sandbox.bwrap.fork_mount_plan``,
    ``image_mount_plan``)."""
    for operation in operations:
        kind, target = operation[0], operation[-1]
        if kind == "private":
            _mount(None, target, None, MS_REC | MS_PRIVATE)
        elif kind == "tmpfs":
            _, size, mode, _ = operation
            _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode={mode}")
        elif kind == "dir":
            os.makedirs(target, mode=0o755, exist_ok=True)
        elif kind in ("bind", "ro-bind"):
            _mount(operation[1], target, None, MS_BIND | MS_REC)
            if kind == "ro-bind":
                _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        elif kind == "proc":
            _mount("proc", target, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        elif kind == "devpts":
            _mount("devpts", target, "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=620")
        elif kind == "rbind":
            _mount(operation[1], target, None, MS_BIND | MS_REC)
        elif kind == "idmap-bind":
            idmapped_bind(operation[1], target, userns)
        elif kind == "overlay":
            _mount("overlay", target, "overlay", MS_NOSUID, operation[1])
        elif kind == "root":
            enter_root(target)
        elif kind == "detach":
            _check(_libc.umount2(target.encode(), MNT_DETACH), f"umount {target}")
        else:
            raise ValueError(f"unknown mount operation {operation!r}")


def loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        flags = struct.unpack("16sH", fcntl.ioctl(probe, SIOCGIFFLAGS, struct.pack("16sH", b"lo", 0)))[1]
        fcntl.ioctl(probe, SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP))


def sandboxed(request: dict, channel: int, log: int, status: int = -1) -> int:
    """Confine this process, then serve the tools on ``channel`` (kept as fd 3) or run the script;
    returns the exit code. ``status`` (the init serving or running a script itself) is kept open
    as the next fd, ``status_fd(request)``."""
    code = 1
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(log, 2)
        os.dup2(channel if request["script"] else devnull, 1)
        kept = ([] if request["script"] else [channel]) + ([status] if status >= 0 else [])
        moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 64) for fd in kept]  # out of the way of 3 and 4
        for number, fd in enumerate(moved):
            os.dup2(fd, 3 + number, inheritable=False)
        os.closerange(3 + len(kept), MAX_FD)
        os.environ.clear()
        os.environ.update(request["env"])
        confine.apply_limits(request["memory_mb"], request["cpu_time_s"], request["max_procs"])
        if request["user"]:
            confine.drop_privileges(request["user"])
            if os.getpid() == 1:  # the init itself: a change of uid cleared its parent-death signal (the
                _die_with_parent()  # server's CAP_KILL lets the kernel send it to a process of another uid)
        _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
        os.umask(0o022)
        os.chdir(request["workspace"])
        if request["script"]:
            code = confine.run(request["script"])
        else:
            toolbox = action_server.Toolbox(request["workspace"], dict(os.environ), request["tools"])
            connection = socket.socket(fileno=3)
            connection.setblocking(True)
            action_server.serve_connection(connection, toolbox)
            code = 0
    except SystemExit as exc:
        code = confine.exit_status(exc)
    except BaseException:
        traceback.print_exc()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    return code


def status_fd(request: dict) -> int:
    """Where a sandbox's init serving or running a script itself keeps its status pipe."""
    return 3 if request["script"] else 4


def init(request: dict, channel: int, log: int, status: int, userns: int = -1) -> None:
    """P1, pid 1 of the sandbox: set up its file system and network, then serve the tools or run a
    Python script itself, or start P2 (a program) and reap. Never returns."""
    try:
        apply_mounts(request["mounts"], userns)
        if userns >= 0:
            os.close(userns)
        socket.sethostname("sandbox")
        loopback_up()
        os.setsid()  # booted: out of this server's session, and so of its lowered priority
        restore_priority()
        if not request["script"] or confine.runs_in_process(request["script"]):
            code = sandboxed(request, channel, log, status)
            report(status_fd(request), str(code))
            os._exit(code)
        program = os.fork()
        if program == 0:
            os.close(status)
            os._exit(sandboxed(request, channel, log))
        os.close(channel)
        os.close(log)
        while True:
            pid, wait_status = os.wait()
            if pid == program:
                report(status, str(os.waitstatus_to_exitcode(wait_status)))
                os._exit(0)
    except BaseException:
        report(log, traceback.format_exc())
        os._exit(1)


def report(fd: int, text: str) -> None:
    """Write ``text`` to ``fd`` if it is still there (the worker may have stopped reading, or the
    sandbox closed it): a forked sandbox must reach its ``os._exit``, never this server's loop."""
    try:
        os.write(fd, text.encode())
    except OSError:
        pass


def spawn(request: dict, fds: list[int], control: socket.socket, namespaces: int, own_pid_namespace: int) -> int:
    """Fork P1 for ``request`` as pid 1 of a new pid namespace; returns its pid here, in the server."""
    userns = mapping_namespace(request["user"]) if request.get("idmap") else -1
    try:
        _check(_libc.unshare(CLONE_NEWPID), "unshare(CLONE_NEWPID)")  # for the next child only
        try:
            pid = os.fork()
        except BaseException:
            _check(_libc.setns(own_pid_namespace, CLONE_NEWPID), "setns")
            raise
    except BaseException:
        if userns >= 0:
            os.close(userns)
        raise
    if pid:  # back to forking into our own pid namespace, so that the next unshare works
        if userns >= 0:
            os.close(userns)
        _check(_libc.setns(own_pid_namespace, CLONE_NEWPID), "setns")
        return pid
    channel, log, status = fds
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        _die_with_parent()
        control.close()
        os.close(own_pid_namespace)
        _check(_libc.unshare(namespaces), "unshare")
        init(request, channel, log, status, userns)
    except BaseException:
        report(log, traceback.format_exc())
    finally:
        os._exit(1)


def reap(*_: object) -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def supported_namespaces() -> int:
    """Every namespace the sandbox's init unshares (its pid namespace it is born in); the cgroup one
    only where the kernel has it."""
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    return flags | CLONE_NEWCGROUP if os.path.exists("/proc/self/ns/cgroup") else flags


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    options = dict(zip(argv[::2], argv[1::2]))
    if (
        len(argv) % 2
        or set(options) - {"--control-fd", "--boot-niceness"}
        or not all(value.isdigit() for value in options.values())
        or "--control-fd" not in options
    ):
        raise SystemExit(
            "usage: zygote --control-fd FD [--boot-niceness N] (FD: a SOCK_SEQPACKET socket to the worker)"
        )
    lower_priority(int(options.get("--boot-niceness", "0")))
    control = socket.socket(fileno=int(options["--control-fd"]))
    control.setblocking(True)  # a green worker's sockets come non-blocking
    gc.freeze()  # a collection in a forked child would otherwise write to, and so copy, every page
    signal.signal(signal.SIGCHLD, reap)
    namespaces = supported_namespaces()
    own_pid_namespace = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    os.write(1, b"ready\n")
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(control, MAX_REQUEST_BYTES, 3)
        except OSError:
            return
        if not message:
            return
        answer: dict[str, int | str]
        try:
            if len(fds) != 3:
                raise ValueError(f"a request needs 3 file descriptors, got {len(fds)}")
            answer = {"pid": spawn(json.loads(message), fds, control, namespaces, own_pid_namespace)}
        except Exception as exc:
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            for fd in fds:
                os.close(fd)
        control.send(json.dumps(answer).encode())


if __name__ == "__main__":
    main()
