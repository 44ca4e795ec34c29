import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_service.concurrency import priority


def test_a_lowered_process_ranks_at_its_niceness_until_it_starts_a_session_of_its_own() -> None:
    script = (
        "import os; from rollout_service.concurrency.priority import lower_priority, rank, restore_priority\n"
        "lower_priority(7); print(rank(os.getpid()))\n"
        "if os.fork() == 0:\n"
        "    os.setsid(); restore_priority(); print(rank(os.getpid()), flush=True); os._exit(0)\n"
        "os.wait()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parents[2],
        start_new_session=True,
    ).stdout.split()  # not the suite's session
    assert out[0] == "7"
    assert out[1] == (
        "0" if os.geteuid() == 0 or priority.autogroups_on() else "7"
    )  # lowering a nice value back needs CAP_SYS_NICE


def test_a_process_in_the_default_autogroup_is_ranked_by_its_nice_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel shows an empty autogroup file for init's session and where making a session's group failed."""
    (tmp_path / str(os.getpid())).write_text("")
    monkeypatch.setattr(priority, "AUTOGROUP_OF_PROCESS", str(tmp_path / "{pid}"))
    monkeypatch.setattr(priority, "autogroups_on", lambda: True)
    assert priority.rank(os.getpid()) == os.getpriority(os.PRIO_PROCESS, 0)


def test_another_process_and_its_session_are_lowered_by_its_pid() -> None:
    child = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        priority.lower_priority_of([child.pid, 2**22 + 1], 13)  # a pid that does not exist is skipped
        assert priority.rank(child.pid) == 13 and os.getpriority(os.PRIO_PROCESS, child.pid) == 13
    finally:
        child.kill()
        child.wait()
