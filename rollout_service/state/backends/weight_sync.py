"""Weight sync: the pause that stops new LLM calls while a trainer loads weights, and the policy
version every call records (it only goes up)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, cast

import redis

from rollout_service.errors import ValidationError
from rollout_service.state.backends.layout import LUA_KEYS, backend_key
from rollout_service.state.connection import scripts_of

# ARGV: prefix, version ('' : current + 1, or current if new weights were loaded during the pause),
# '1' to lift the pause as well ('0': only move the version, the engines resume first).
_RESUME = (
    LUA_KEYS
    + """
local current = tonumber(redis.call('GET', key('version')) or '0')
local version = current + 1
if ARGV[2] ~= '' then version = tonumber(ARGV[2])
elseif redis.call('EXISTS', key('updated')) == 1 then version = current end
if version < current then return {0, current} end
redis.call('SET', key('version'), version)
redis.call('DEL', key('updated'))
if ARGV[3] ~= '0' then
  redis.call('DEL', key('paused'))
  redis.call('PUBLISH', key('resumed'), version)
end
return {1, version}
"""
)

# New weights are in the engines: ARGV: prefix, their version ('' : current + 1).
_WEIGHTS_LOADED = (
    LUA_KEYS
    + """
local current = tonumber(redis.call('GET', key('version')) or '0')
local version = current + 1
if ARGV[2] ~= '' then version = tonumber(ARGV[2]) end
if version < current then return {0, current} end
redis.call('SET', key('version'), version)
local pause_ms = redis.call('PTTL', key('paused'))
if pause_ms > 0 then redis.call('SET', key('updated'), 1, 'PX', pause_ms) end
return {1, version}
"""
)

# The service's pause lapsed (its ttl) while the engines it paused are still paused: '1' for the one
# caller that resumes them.
_LAPSED = (
    LUA_KEYS
    + """
if redis.call('EXISTS', key('paused')) == 1 then return 0 end
return redis.call('DEL', key('engines_paused'))
"""
)


class WeightSync:
    def __init__(self, redis_client: redis.Redis, prefix: str) -> None:
        self.redis = redis_client
        self.prefix = prefix
        self._resume, self._weights_loaded, self._lapsed = scripts_of(redis_client, _RESUME, _WEIGHTS_LOADED, _LAPSED)

    def _key(self, name: str) -> str:
        return backend_key(self.prefix, name)

    def pause(self, ttl_s: float) -> None:
        """Stop new LLM calls for ``ttl_s`` seconds, or until resume(); pausing again renews it
        (a trainer that dies mid-sync must not leave the service paused for good)."""
        self.redis.set(self._key("paused"), 1, px=max(int(ttl_s * 1000), 1))

    def engines_paused(self, paused: bool) -> None:
        """Whether the engines are paused as well (the probe round resumes them if the pause lapses)."""
        if paused:
            self.redis.set(self._key("engines_paused"), 1)
        else:
            self.redis.delete(self._key("engines_paused"))

    def take_lapsed_engine_pause(self) -> bool:
        """True for the one caller that must resume the engines: the pause lapsed (a trainer died
        mid-sync) while the engines it paused are still paused."""
        return bool(int(self._lapsed(args=[self.prefix])))

    def pause_expires_in_s(self) -> float | None:
        ttl_ms = cast(int, self.redis.pttl(self._key("paused")))
        return ttl_ms / 1000 if ttl_ms >= 0 else None

    def paused(self) -> bool:
        return bool(self.redis.exists(self._key("paused")))

    def resume(self, policy_version: int | None = None, lift: bool = True) -> int:
        """Move to ``policy_version`` (None: one up, or the version of weights loaded during this
        pause) and lift the pause; ``lift=False`` moves the version only (calls a keep-mode pause
        froze in the engines then end under it)."""
        requested = "" if policy_version is None else str(int(policy_version))
        return _versioned(self._resume(args=[self.prefix, requested, "1" if lift else "0"]), policy_version)

    def weights_loaded(self, policy_version: int | None = None) -> int:
        """Every engine of a pool now serves new weights: the policy version moves to
        ``policy_version`` (None: one up) at once; during a pause, resume keeps it."""
        requested = "" if policy_version is None else str(int(policy_version))
        return _versioned(self._weights_loaded(args=[self.prefix, requested]), policy_version)

    def policy_version(self) -> int:
        return int(cast("bytes | None", self.redis.get(self._key("version"))) or 0)

    def check_version(self, policy_version: int | None) -> None:
        """A ValidationError if ``policy_version`` is below the current one (versions only go up)."""
        if policy_version is not None and policy_version < self.policy_version():
            _versioned([0, self.policy_version()], policy_version)

    def wait_resumed(self, timeout_s: float, should_stop: Callable[[], bool]) -> bool:
        """Block until not paused (True), or until timeout / should_stop() (False)."""
        if not self.paused():
            return True
        deadline = time.monotonic() + timeout_s
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.subscribe(self._key("resumed"))
            while self.paused():  # checked after subscribing, so no resume is missed
                remaining = deadline - time.monotonic()
                if remaining <= 0 or should_stop():
                    return False
                pubsub.get_message(timeout=min(0.25, remaining))
            return True
        finally:
            pubsub.close()


def _versioned(reply: list[Any], policy_version: int | None) -> int:
    accepted, version = reply
    if not int(accepted):
        raise ValidationError(
            f"policy_version {policy_version} is below the current {int(version)}; versions "
            "only go up: pass a version >= the current one, or omit it to bump by one"
        )
    return int(version)
