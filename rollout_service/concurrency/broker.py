"""Everything that knows how kombu's Redis transport stores its messages: the key of a queue and its
priority steps, the ``unacked`` hash, the JSON of a stored message (scanned in Lua for the jobs it
carries), a channel that publishes through one client, and a poller that hands control back while
the prefetch window is full. workers/dispatch.py names queues and tasks; this module alone names
kombu's keys and internals (the workers' Celery app uses its ``TRANSPORT``)."""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Iterator, Sequence
from queue import Empty
from typing import Any, cast

import redis
from kombu.transport import redis as kombu_redis

# A queue is a list named after it, plus one list per extra priority step; messages delivered and
# not acked yet sit in the ``unacked`` hash as JSON ``[message, exchange, routing_key]``.
PRIORITY_SEPARATOR = "\x06\x16"
PRIORITY_STEPS = (3, 6, 9)
UNACKED_KEY = "unacked"
# A message body is stored base64-encoded but its headers as plain JSON: this header lists the
# message's jobs as "<job id>.<stage>" marks, so a server-side scan can tell which jobs a queue holds.
JOBS_HEADER = "rollout_jobs"
SCAN_CHUNK = 500  # messages per server-side scan step (bounded Redis time per script call)
PAUSED_POLL_S = 0.01

# Which of ARGV[3:] (marks) the messages of list KEYS[1] from index ARGV[1] to ARGV[2] carry
# (a hash's values when ARGV[1] is -1).
_MESSAGES_PRESENT = """
local wanted, found = {}, {}
for i = 3, #ARGV do wanted[ARGV[i]] = true end
local raws
if ARGV[1] == '-1' then raws = redis.call('HVALS', KEYS[1])
else raws = redis.call('LRANGE', KEYS[1], ARGV[1], ARGV[2]) end
for _, raw in ipairs(raws) do
  local marks = string.match(raw, '"rollout_jobs": %[(.-)%]')
  if marks then
    for mark in string.gmatch(marks, '"([^"]+)"') do
      if wanted[mark] then found[#found + 1] = mark; wanted[mark] = nil end
    end
  end
end
return {found, #raws}
"""


def queue_keys(queue: str) -> list[str]:
    """The lists that hold ``queue``'s waiting messages: the plain one (priority 0), then one per step."""
    return [queue, *(f"{queue}{PRIORITY_SEPARATOR}{step}" for step in PRIORITY_STEPS)]


def messages_present(client: redis.Redis, queues: Sequence[str], marks: list[str]) -> set[str]:
    """The marks (see JOBS_HEADER) that some message waiting in one of ``queues``, or delivered and
    not acked yet, carries. Scans every queue list head to tail in chunks of SCAN_CHUNK (kombu pushes
    at the head and pops at the tail, so a message that stays queued is never skipped), then the
    unacked hash; only matches come back from the server."""
    wanted, found = list(marks), set[str]()
    script = client.register_script(_MESSAGES_PRESENT)
    for key in [key for queue in queues for key in queue_keys(queue)]:
        start = 0
        while wanted:
            hits, seen = script(keys=[key], args=[start, start + SCAN_CHUNK - 1, *wanted])
            found.update(t.decode() for t in hits)
            wanted = [t for t in wanted if t not in found]
            if seen < SCAN_CHUNK:
                break
            start += SCAN_CHUNK
    if wanted:
        hits, _ = script(keys=[UNACKED_KEY], args=[-1, 0, *wanted])
        found.update(t.decode() for t in hits)
    return found


def queue_lengths(client: redis.Redis, queues: Sequence[str]) -> dict[str, dict[str, int]]:
    """Per queue: ``queued`` (messages waiting in its lists, every priority step) and ``unacked``
    (delivered to a worker and not acked yet). With late acks ``unacked`` counts reserved *and*
    running tasks: kombu does not record in Redis whether a delivered task started."""
    pipe = client.pipeline(transaction=False)
    for queue in queues:
        for key in queue_keys(queue):
            pipe.llen(key)
    pipe.hvals(UNACKED_KEY)
    replies = pipe.execute()
    per_queue = 1 + len(PRIORITY_STEPS)
    lengths = {
        q: {"queued": sum(replies[i * per_queue : (i + 1) * per_queue]), "unacked": 0} for i, q in enumerate(queues)
    }
    for raw in replies[-1]:
        routing_key, _ = unacked_route(raw)
        if routing_key in lengths:
            lengths[routing_key]["unacked"] += 1
    return lengths


def unacked_route(raw: bytes) -> tuple[str, str]:
    """(queue, task id) of one ``unacked`` entry, JSON ``[message, exchange, routing_key]``; ("", "")
    for one that is not."""
    try:
        message, _exchange, routing_key = json.loads(raw)
        delivery = message.get("properties", {}).get("delivery_info", {})
        return routing_key or delivery.get("routing_key", ""), message.get("headers", {}).get("id", "")
    except (ValueError, TypeError, AttributeError):
        return "", ""


class Channel(kombu_redis.Channel):
    """kombu's Redis channel, publishing through one client: kombu's makes a ``redis.Redis`` for
    every message it sends (its table of reply callbacks), for every task event and stage hand-off
    of a run worker. The clients shared the channel's connection pool anyway."""

    @contextlib.contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        yield client or self._publishing_client

    @functools.cached_property
    def _publishing_client(self) -> redis.Redis:
        return cast(redis.Redis, self._create_client())


class Transport(kombu_redis.Transport):
    Channel = Channel


TRANSPORT = f"{__name__}:Transport"  # Celery's broker_transport; a worker reports the name in its stats


def wake_soon_when_paused() -> None:
    """Green pools (gevent) run Celery's synloop, which sends the acks of finished tasks only
    between two polls, while kombu's Redis transport keeps polling for up to 2 s once the
    prefetch window is full: a worker with every slot busy then idled up to 2 s each time one
    freed. With the window full, poll for PAUSED_POLL_S and hand control back, so the acks go out."""
    poller = kombu_redis.MultiChannelPoller
    if getattr(poller.get, "_rollout_patched", False):
        return
    original: Callable[..., Any] = poller.get

    def get(self: object, callback: object, timeout: float | None = None) -> object:
        channels = getattr(self, "_channels", ())
        if any(channel.active_queues and not channel.qos.can_consume() for channel in channels):
            try:  # window full: look briefly, then hand control back so pending acks go out
                return original(self, callback, PAUSED_POLL_S)
            except Empty:
                raise TimeoutError() from None
        return original(self, callback, timeout)

    get._rollout_patched = True  # type: ignore[attr-defined]
    setattr(poller, "get", get)  # noqa: B010  (kombu's stubs differ between installs: no method-assign check)
