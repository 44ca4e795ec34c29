"""LLM calls in flight, counted per job (``calls`` hash) so a weight-sync pause can wait for them;
each call's end reads the policy version it ended under."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import redis

from rollout_service.concurrency.autopipeline import submit, submit_commands
from rollout_service.state.backends.layout import LUA_KEYS, backend_key
from rollout_service.state.connection import as_text, scripts_of

_BEGIN_CALL = (
    LUA_KEYS
    + """
if redis.call('EXISTS', key('paused')) == 1 then return false end
redis.call('HINCRBY', key('calls'), ARGV[2], 1)
return tonumber(redis.call('GET', key('version')) or '0')
"""
)

# KEYS: the in-flight calls hash, the version key. ARGV: job.
_END_CALL = """
if redis.call('HINCRBY', KEYS[1], ARGV[1], -1) <= 0 then redis.call('HDEL', KEYS[1], ARGV[1]) end
return redis.call('GET', KEYS[2]) or '0'
"""


class InflightCalls:
    def __init__(self, redis_client: redis.Redis, prefix: str) -> None:
        self.redis = redis_client
        self.prefix = prefix
        self._calls_key = backend_key(prefix, "calls")
        self._version_key = backend_key(prefix, "version")
        self._begin_call, self._end_call = scripts_of(redis_client, _BEGIN_CALL, _END_CALL)

    def begin_call(self, job_id: str) -> int | None:
        """Start an LLM call: None while paused, else the policy version the call runs under."""
        version = self._begin_call(args=[self.prefix, job_id])
        return None if version is None else int(version)

    def end_call(self, job_id: str) -> Callable[[], int | None]:
        """The call is over. Its answer, the policy version when it ended, rides the next shared
        round trip: read it later (``TrajectoryBuilder`` does when the turn is settled), never wait.
        Harmless for a call that was not counted (its job's count never goes below 0)."""
        pending = submit(self.redis, self._end_call, keys=[self._calls_key, self._version_key], args=[job_id])

        def version() -> int | None:
            try:
                return int(as_text(pending()))
            except Exception:  # a Redis blip: the turn records its start version only
                return None

        return version

    def end_counted_call(self, job_id: str) -> Callable[[], int | None]:
        """``end_call`` for a call its start's answer says was counted, in two plain commands (its
        job's count stays at 0 until the job's backend is released)."""
        pending = submit_commands(self.redis, [("HINCRBY", self._calls_key, job_id, -1), ("GET", self._version_key)])
        return _version_of(pending, 1)

    def version_soon(self) -> Callable[[], int | None]:
        """The policy version now, read with the next shared round trip (the end of a call its
        worker's gate carried, not counted here)."""
        return _version_of(submit_commands(self.redis, [("GET", self._version_key)]), 0)

    def check_call_soon(self, job_id: str, job_key: str) -> Callable[[], tuple[str, str]]:
        """What a call started under its worker's gate checks once it has ended (the gate counts the
        call): ``("ok" | "cancelled", backend the job is assigned to)``, read when first asked for,
        so it rides the shared round trip of the call's end (``version_soon``) instead of one of its own."""
        sent: list[Callable[[], list[Any]]] = []
        assignment_key = backend_key(self.prefix, "job", job_id)

        def answer() -> tuple[str, str]:
            if not sent:
                sent.append(
                    submit_commands(self.redis, [("HGET", job_key, "cancel_requested"), ("GET", assignment_key)])
                )
            replies = sent[0]()
            if errors := [reply for reply in replies if isinstance(reply, Exception)]:
                raise errors[0]
            cancel, assigned = replies
            return "cancelled" if as_text(cancel or b"") == "1" else "ok", as_text(assigned or b"")

        return answer

    def inflight_calls(self) -> int:
        counts = cast("list[bytes]", self.redis.hvals(self._calls_key))
        return sum(int(count) for count in counts)


def _version_of(pending: Callable[[], list[Any]], at: int) -> Callable[[], int | None]:
    def version() -> int | None:
        try:
            return int(as_text(pending()[at] or 0))
        except Exception:  # a Redis blip: the turn records its start version only
            return None

    return version
