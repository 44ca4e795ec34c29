"""Lowering a process's CPU priority so that it counts where Linux groups processes by session.

With autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``, on by default in many
distributions) every session is one scheduling group, and a nice value only ranks a process
within its own session: a niced process that started a session of its own (every worker, Flower,
the sandboxes' fork server) still competes with every other session as an equal. The session's
autogroup nice (``/proc/self/autogroup``) is what ranks it among sessions. Stdlib only: the
sandboxes' fork server imports it.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterable

AUTOGROUP_SWITCH = "/proc/sys/kernel/sched_autogroup_enabled"
AUTOGROUP_OF_PROCESS = "/proc/{pid}/autogroup"
AUTOGROUP_WRITE_TRIES = 4


def autogroups_on() -> bool:
    try:
        with open(AUTOGROUP_SWITCH) as f:
            return f.read().strip() == "1"
    except OSError:
        return False


def lower_priority(niceness: int) -> None:
    """Rank this process's session (with autogroups) and this process at ``niceness``; what it starts
    inherits both until it starts a session of its own. The process's own nice value is what counts
    without autogroups and in the kernel's default autogroup, whose nice cannot be set. Best effort:
    raising a nice value needs no privilege, and a refusal leaves the priority as it was."""
    if niceness <= 0:
        return
    if autogroups_on():
        _nice_autogroup("self", niceness, AUTOGROUP_WRITE_TRIES)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, niceness)
    except OSError:
        pass


def lower_priority_of(pids: Iterable[int], niceness: int) -> None:
    """Rank other processes (and, with autogroups, their sessions) at ``niceness``, without waiting:
    a refusal (a process gone, another user's, the kernel's rate limit on autogroup writes without
    CAP_SYS_ADMIN) leaves that one as it was. For processes about to be killed: their exit (a
    sandbox's memory and namespaces torn down) then yields to live work."""
    if niceness <= 0:
        return
    groups = autogroups_on()
    for pid in pids:
        if groups:
            _nice_autogroup(pid, niceness, tries=1)
        try:
            os.setpriority(os.PRIO_PROCESS, pid, niceness)
        except OSError:
            pass


def _nice_autogroup(pid: int | str, niceness: int, tries: int) -> None:
    """Set the autogroup nice of ``pid``'s session; a refusal other than the rate limit ends it
    (EINVAL: the kernel's default autogroup, whose nice cannot be set)."""
    for attempt in range(tries):
        try:
            with open(AUTOGROUP_OF_PROCESS.format(pid=pid), "w") as f:
                f.write(str(niceness))
            return
        except OSError as e:
            if e.errno != errno.EAGAIN or attempt == tries - 1:
                return
            time.sleep(0.1)  # without CAP_SYS_ADMIN the kernel takes one such write per 100 ms, system-wide


def restore_priority() -> None:
    """Back to nice 0 for a process that inherited a lowered one and has just started a session of
    its own (whose autogroup starts at 0). Needs CAP_SYS_NICE; without it the nice value stays."""
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) > 0:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
    except OSError:
        pass


def rank(pid: int) -> int:
    """What ranks process ``pid`` against the others: its session's autogroup nice where autogroups
    are on, else its own nice value (what ``lower_priority`` set). A process in the kernel's default
    autogroup (init's session, or where making a new one failed) shows an empty autogroup file, cannot
    have its autogroup niced, and is ranked by its nice value as without autogroups."""
    if autogroups_on():
        with open(AUTOGROUP_OF_PROCESS.format(pid=pid)) as f:
            fields = f.read().split()
        if "nice" in fields:
            return int(fields[fields.index("nice") + 1])
    return os.getpriority(os.PRIO_PROCESS, pid)
