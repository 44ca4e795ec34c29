"""Background work in a gevent-patched process (a run worker) and in a plain one."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from rollout_service.green import green_process, in_background


def test_in_a_green_worker_background_work_is_started_without_waiting_for_it_to_begin() -> None:
    script = textwrap.dedent("""
        from gevent import monkey; monkey.patch_all()
        import json, threading
        from rollout_service.green import green_process, in_background
        ran = []
        join = in_background(ran.append, "done", name="work")
        before = list(ran)
        started = threading.Thread(target=ran.append, args=("thread",))
        started.start()  # what Thread.start() does instead: it waits until the new thread has run
        after_thread_start = list(ran)
        join()
        print(json.dumps({"green": green_process(), "before": before, "after_thread_start": after_thread_start,
                          "joined": ran}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    result = json.loads(out.stdout)
    assert result["green"] is True
    assert result["before"] == []  # a greenlet spawned, not run yet: the caller went on at once
    assert "thread" in result["after_thread_start"]
    assert sorted(result["joined"]) == ["done", "thread"]


def test_in_a_plain_process_background_work_runs_in_a_thread_and_can_be_joined() -> None:
    ran: list[str] = []
    assert not green_process()
    join = in_background(ran.append, "done", name="work")
    join()
    assert ran == ["done"]
