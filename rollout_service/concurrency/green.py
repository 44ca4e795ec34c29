"""Background work that works the same in threads and in gevent's green workers."""

from __future__ import annotations

import gc
import select
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

GREEN_MODULES = ("socket", "threading", "subprocess")  # what the green code paths rely on gevent for


def green_process() -> bool:
    """Whether gevent has patched this process (run and init workers: ``monkey.patch_all()``); a
    process that never imported gevent is not green."""
    gevent_monkey = sys.modules.get("gevent.monkey")
    return gevent_monkey is not None and all(gevent_monkey.is_module_patched(name) for name in GREEN_MODULES)


def in_background(target: Callable[..., Any], *args: Any, name: str) -> Callable[[], Any]:
    """Run ``target(*args)`` concurrently and return at once; the result joins it. In a green worker
    it is a greenlet: ``threading.Thread.start()`` waits until the new thread has run, and in a busy
    green worker that is a whole round of its hub, which the episode starting it would wait for."""
    if green_process():
        import gevent

        greenlet = gevent.spawn(target, *args)
        greenlet.name = name
        return greenlet.join
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    thread.start()
    return thread.join


def after_live_work(cap_s: float) -> None:
    """In a green worker, return once its hub has nothing else ready to run, or after ``cap_s``:
    work that can wait (an ended episode's records) yields the CPU to the episodes whose LLM
    answers are in. Elsewhere at once."""
    if not green_process():
        return
    import gevent

    with gevent.Timeout(cap_s, False):
        gevent.idle()


def wait_ready(fd: Any, timeout_s: float | None, events: int = select.POLLIN) -> bool:
    """Whether ``fd`` (a number or an object with ``fileno()``) is ready for ``events`` (readable, or
    at its end, by default) within ``timeout_s`` (None: no limit). ``poll``, not ``select``, which
    refuses fd numbers from 1024 on (a worker with hundreds of sandboxes holds more); gevent's poll
    in a green worker."""
    poller = select.poll()
    poller.register(fd, events)
    return bool(poller.poll(None if timeout_s is None else max(timeout_s, 0.0) * 1000))


IDLE_MIN_ALLOCATIONS = 10_000  # fewer new live objects than this: at most that much garbage, not worth a pass


class IdleCollector:
    """The cyclic garbage collector of a green worker, run when the worker is idle instead of when
    allocations say so. Hundreds of live episodes hold many tracked objects (token lists among
    them) and leave next to no cycles, while each pass stalls every episode of the process.
    ``take_over`` turns automatic collection off; ``tick`` collects when ``is_idle()``, or after
    ``max_interval_s`` of load (the stall then, bounded garbage in between)."""

    def __init__(self, is_idle: Callable[[], bool], max_interval_s: float) -> None:
        self.is_idle, self.max_interval_s = is_idle, max_interval_s
        self.collected_at = time.monotonic()

    def take_over(self, check_s: float) -> None:
        gc.disable()
        in_background(self._forever, check_s, name="idle-collector")

    def tick(self) -> bool:
        now = time.monotonic()
        allocated = gc.get_count()[
            0
        ]  # tracked objects made and still alive since the last pass (counted while disabled)
        if now - self.collected_at < self.max_interval_s and not (self.is_idle() and allocated >= IDLE_MIN_ALLOCATIONS):
            return False
        gc.collect()
        self.collected_at = time.monotonic()
        return True

    def _forever(self, check_s: float) -> None:
        while True:
            time.sleep(check_s)
            self.tick()


def collect_when_idle(is_idle: Callable[[], bool], max_interval_s: float, check_s: float) -> IdleCollector | None:
    """In a green worker, an ``IdleCollector`` checking every ``check_s`` takes over the cyclic
    garbage collector; elsewhere collection stays automatic (None)."""
    if not green_process():
        return None
    collector = IdleCollector(is_idle, max_interval_s)
    collector.take_over(check_s)
    return collector
