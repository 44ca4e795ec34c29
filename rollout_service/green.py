"""Background work that works the same in threads and in gevent's green workers."""
from __future__ import annotations

import select
import sys
import threading
from typing import Any, Callable, Optional


GREEN_MODULES = ("socket", "threading", "subprocess")  # what the green code paths rely on gevent for


def green_process() -> bool:
    """Whether gevent has patched this process (run and init workers: ``monkey.patch_all()``); a
    process that never imported gevent is not green."""
    gevent_monkey = sys.modules.get("gevent.monkey")
    return gevent_monkey is not None and all(gevent_monkey.is_module_patched(name) for name in GREEN_MODULES)


def in_background(target: Callable[..., Any], *args: Any, name: str) -> Callable[[], Any]:
    """Run ``target(*args)`` concurrently and return at once; the result joins it. In a green worker
    it is a greenlet: ``threading.Thread.start()`` waits until the new thread has run, and in a busy
    green worker that is a whole round of its hub (200 sandboxed episodes on 2 cores: 67 ms p50 and
    220 ms p90 to start a sandbox's teardown, paid by the episode)."""
    if green_process():
        import gevent

        greenlet = gevent.spawn(target, *args)
        greenlet.name = name
        return greenlet.join
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    thread.start()
    return thread.join


def wait_ready(fd: Any, timeout_s: Optional[float], events: int = select.POLLIN) -> bool:
    """Whether ``fd`` (a number or an object with ``fileno()``) is ready for ``events`` (readable, or
    at its end, by default) within ``timeout_s`` (None: no limit). ``poll``, not ``select``, which
    refuses fd numbers from 1024 on (a worker with hundreds of sandboxes holds more); gevent's poll
    in a green worker."""
    poller = select.poll()
    poller.register(fd, events)
    return bool(poller.poll(None if timeout_s is None else max(timeout_s, 0.0) * 1000))
