"""Lowering a process's CPU priority so that it counts where Linux groups processes by session.

With autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``, on by default in many
distributions) every session is one scheduling group, and a nice value only ranks a process
within its own session: a niced process that started a session of its own (every worker, Flower,
the sandboxes' fork server) still competes with every other session as an equal. The session's
autogroup nice (``/proc/self/autogroup``) is what ranks it among sessions. Stdlib only: the
sandboxes' fork server imports it.
"""
from __future__ import annotations

import os

AUTOGROUP_SWITCH = "/proc/sys/kernel/sched_autogroup_enabled"


def autogroups_on() -> bool:
    try:
        with open(AUTOGROUP_SWITCH) as f:
            return f.read().strip() == "1"
    except OSError:
        return False


def lower_priority(niceness: int) -> None:
    """Rank this process's session (with autogroups) or this process (without) at ``niceness``;
    what it starts inherits it until it starts a session of its own. Best effort: raising a nice
    value needs no privilege, and a refusal leaves the priority as it was."""
    if niceness <= 0:
        return
    if autogroups_on():
        try:
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(niceness))
            return
        except OSError:
            pass
    try:
        os.setpriority(os.PRIO_PROCESS, 0, niceness)
    except OSError:
        pass


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
    are on, else its own nice value (what ``lower_priority`` set)."""
    if autogroups_on():
        with open(f"/proc/{pid}/autogroup") as f:
            return int(f.read().split("nice")[1])
    return os.getpriority(os.PRIO_PROCESS, pid)
