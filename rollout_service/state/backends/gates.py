"""Run workers' call gates (``runtime.llm.CallGate``): a worker's lease to start LLM calls without
a round trip each, a member of ``gates`` scored by when it closes (Redis time, ms). A weight-sync
pause refuses renewals and waits for the open gates."""

from __future__ import annotations

import redis

from rollout_service.concurrency.autopipeline import submit_commands
from rollout_service.state.backends.layout import LUA_KEYS, backend_key
from rollout_service.state.connection import as_text, scripts_of

_LUA_GATES = (
    LUA_KEYS
    + """
local function now_ms() local t = redis.call('TIME') return t[1] * 1000 + math.floor(t[2] / 1000) end
"""
)

# ARGV: prefix, owner, lease ms, '1' while calls started under the gate are in flight. Refused while
# paused (a gate still open and busy stays open, its calls counted by the pause until they end); else
# open until now + lease. The last element: 1 if the gate had not lapsed (held since its last renewal).
_RENEW_GATE = (
    _LUA_GATES
    + """
local gates, now = key('gates'), now_ms()
local open_until = redis.call('ZSCORE', gates, ARGV[2])
local held = (open_until and tonumber(open_until) > now) and 1 or 0
if redis.call('EXISTS', key('paused')) == 1 then
  if held == 1 and ARGV[4] == '1' then redis.call('ZADD', gates, now + tonumber(ARGV[3]), ARGV[2]) end
  return {'paused', held}
end
redis.call('ZADD', gates, now + tonumber(ARGV[3]), ARGV[2])
return {'ok', version(), held}
"""
)

_RELEASE_GATE = _LUA_GATES + "return redis.call('ZREM', key('gates'), ARGV[2])"

_OPEN_GATES = (
    _LUA_GATES
    + """
redis.call('ZREMRANGEBYSCORE', key('gates'), '-inf', now_ms())
return redis.call('ZCARD', key('gates'))
"""
)


class CallGates:
    def __init__(self, redis_client: redis.Redis, prefix: str) -> None:
        self.redis = redis_client
        self.prefix = prefix
        self._renew_gate, self._release_gate, self._open_gates = scripts_of(
            redis_client, _RENEW_GATE, _RELEASE_GATE, _OPEN_GATES
        )

    def renew_gate(self, owner: str, lease_s: float) -> int | None:
        """Keep ``owner``'s call gate open for ``lease_s`` more: the policy version, or None while paused."""
        return self.renew_busy_gate(owner, lease_s, False)[0]

    def renew_busy_gate(self, owner: str, lease_s: float, busy: bool) -> tuple[int | None, bool]:
        """``renew_gate`` for a worker whose calls started under the gate are in flight (``busy``):
        refused while paused, the gate is kept open for them if it has not lapsed. Also whether
        the gate had not lapsed since the last renewal (its calls were counted all along)."""
        reply = self._renew_gate(args=[self.prefix, owner, max(int(lease_s * 1000), 1), "1" if busy else "0"])
        if as_text(reply[0]) == "ok":
            return int(as_text(reply[1])), as_text(reply[2]) == "1"
        return None, as_text(reply[1]) == "1"

    def release_gate(self, owner: str) -> None:
        self._release_gate(args=[self.prefix, owner])

    def release_gate_soon(self, owner: str) -> None:
        """``release_gate`` with the next shared round trip, not waited for."""
        submit_commands(self.redis, [("ZREM", backend_key(self.prefix, "gates"), owner)])

    def open_gates(self) -> int:
        """Run workers that may still start calls without asking, or whose calls started under
        their gate are still in flight (a pause waits for them too)."""
        return int(self._open_gates(args=[self.prefix]))
