"""Background work in a gevent-patched process (a run worker) and in a plain one."""

from __future__ import annotations

import gc
import textwrap

from rollout_service.concurrency.green import collect_when_idle, green_process, in_background
from tests.helpers import run_fresh


def test_in_a_green_worker_background_work_is_started_without_waiting_for_it_to_begin() -> None:
    script = textwrap.dedent("""
        from gevent import monkey; monkey.patch_all()
        import json, threading
        from rollout_service.concurrency.green import green_process, in_background
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
    result = run_fresh(script)
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


def test_a_green_worker_collects_cycles_when_idle_or_after_its_longest_interval_never_by_allocation_count() -> None:
    script = textwrap.dedent("""
        import gc, json, time, weakref
        from rollout_service.concurrency.green import IdleCollector
        busy = [True]
        collector = IdleCollector(lambda: not busy[0], max_interval_s=0.5)
        gc.disable()  # what take_over does, without its checking thread

        class Node:
            pass

        def garbage_cycle():
            a, b = Node(), Node()
            a.other, b.other = b, a
            return weakref.ref(a)

        def allocate(n):
            return [[i] for i in range(n)]  # tracked objects, as episodes make

        seen = {}
        cycle = garbage_cycle(); kept = allocate(20_000)  # live objects made since the last pass
        seen["busy"] = (collector.tick(), cycle() is None)
        busy[0] = False
        seen["idle"] = (collector.tick(), cycle() is None)
        seen["idle, nothing new"] = (collector.tick(), True)
        busy[0] = True
        cycle = garbage_cycle(); time.sleep(0.6)
        seen["busy past the interval"] = (collector.tick(), cycle() is None)
        print(json.dumps(seen))
    """)
    assert run_fresh(script) == {
        "busy": [False, False],
        "idle": [True, True],
        "idle, nothing new": [False, True],
        "busy past the interval": [True, True],
    }


def test_work_that_can_wait_runs_after_what_is_ready_in_a_green_worker_and_at_most_its_cap_later() -> None:
    script = textwrap.dedent("""
        from gevent import monkey; monkey.patch_all()
        import gevent, json, socket, time
        from rollout_service.concurrency.green import after_live_work
        a, b = socket.socketpair()
        order = []
        def live_turns():  # answers arriving one after another
            for _ in range(30):
                a.send(b"x"); b.recv(1); order.append("turn")
        def records():
            after_live_work(5.0); order.append("records")
        gevent.joinall([gevent.spawn(records), gevent.spawn(live_turns)])
        def never_idle():
            while True:
                gevent.sleep(0)
        spinning = gevent.spawn(never_idle); gevent.sleep(0)
        started = time.monotonic(); after_live_work(0.1); capped = time.monotonic() - started
        spinning.kill()
        print(json.dumps({"order": order, "capped": capped}))
    """)
    result = run_fresh(script)
    assert result["order"] == ["turn"] * 30 + ["records"]
    assert 0.1 <= result["capped"] < 1.0


def test_only_a_green_worker_hands_the_cyclic_collector_to_an_idle_collector() -> None:
    assert collect_when_idle(lambda: True, max_interval_s=60, check_s=60) is None and gc.isenabled()
    script = textwrap.dedent("""
        from gevent import monkey; monkey.patch_all()
        import gc, json
        from rollout_service.concurrency.green import collect_when_idle
        collector = collect_when_idle(lambda: True, max_interval_s=60, check_s=60)
        print(json.dumps({"collector": type(collector).__name__, "automatic": gc.isenabled()}))
    """)
    assert run_fresh(script) == {"collector": "IdleCollector", "automatic": False}
