"""The host's processes and scratch directories behind sandboxes: naming a process across pid
reuse, finding and killing a process tree, and reaping what dead owners left."""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
import time

from rollout_service.concurrency.priority import lower_priority_of
from rollout_service.settings import get_settings


def process_start_ticks(pid: int) -> int | None:
    """The kernel's start time of ``pid``: with the pid, it names a process across pid reuse."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``. Walks the kernel's per-thread ``children`` lists (the
    subtree only); without them, one scan of every process's parent in /proc, whose cost grows
    with the number of sandboxes running and is paid at every sandbox stop."""
    if not _HAS_CHILDREN_LISTS:
        return _descendants_by_scan(pid)
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            threads = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for thread in threads:
            try:
                with open(f"/proc/{parent}/task/{thread}/children") as f:
                    children = [int(child) for child in f.read().split()]
            except (OSError, ValueError):
                continue
            found += children
            todo += children
    return found


def _descendants_by_scan(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


_HAS_CHILDREN_LISTS = os.path.exists(f"/proc/self/task/{os.getpid()}/children")

SCRATCH_PREFIX = "rollout-"
_OWNED = re.compile(r"^rollout-(\d+)\.(\d+)-")
_owner_tags: dict[int, str] = {}


def owner_tag() -> str:
    """``<pid>.<start ticks>`` of this process: names it across pid reuse."""
    pid = os.getpid()
    if pid not in _owner_tags:
        _owner_tags[pid] = f"{pid}.{process_start_ticks(pid) or 0}"
    return _owner_tags[pid]


def make_scratch_dir(label: str, parent: str | None = None) -> str:
    """A new private directory named after this process (``rollout-<pid>.<ticks>-<label>-…``), in the
    sandbox scratch directory unless ``parent`` is given: once the process is gone, a reaper knows it is
    nobody's (``sweep_orphaned_scratch``), even if it was never registered anywhere."""
    return tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{owner_tag()}-{label}-", dir=parent or get_settings().scratch_path)


def owner_alive(pid: int, start_ticks: int) -> bool:
    return pid > 0 and process_start_ticks(pid) == start_ticks


def sweep_orphaned_scratch(directories: list[str]) -> list[str]:
    """Remove the scratch directories (``make_scratch_dir``) of processes that are gone; returns them."""
    removed = []
    for directory in dict.fromkeys(directories):
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            owner = _OWNED.match(name)
            if owner and not owner_alive(int(owner[1]), int(owner[2])):
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
                removed.append(os.path.join(directory, name))
    return removed


def kill_tree(pid: int, niceness: int = 0, namespace_init: bool = False) -> None:
    """SIGKILL a process group leader and every descendant, including ones in other sessions,
    first lowered to ``niceness`` (``priority.lower_priority_of``: their exit yields to live
    work). Looks again after 1, 2, 4, 8, then every 10 ms (~0.5 s in all) until none is left: a
    sandbox's processes are usually gone after the first round. The init of a pid namespace
    (``namespace_init``) takes every process of its namespace with it: one round. The pauses
    between rounds leave the CPU to the episodes still running while many sandboxes are torn
    down together at the end of a step."""
    delay_s = 0.001
    for round_number in range(55):
        victims = descendants(pid)
        if round_number == 0:
            lower_priority_of([pid, *victims], niceness)
        for target in [pid, *victims]:
            try:
                os.killpg(target, signal.SIGKILL) if target == pid else os.kill(target, signal.SIGKILL)
            except OSError:
                pass
        if not victims or namespace_init:
            return
        time.sleep(delay_s)
        delay_s = min(delay_s * 2, 0.01)
