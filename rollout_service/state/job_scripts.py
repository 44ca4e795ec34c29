"""The Lua scripts behind a job's status moves and stage begins and ends: each runs atomically in
Redis, so a job reaches exactly one terminal state whatever redeliveries, cancels and deadlines race
for it."""

from __future__ import annotations

from rollout_service.state.keys import ATTEMPT_FIELDS, STAGE_TIMES

# What a terminal move answers with: the fields the metrics and the finish hooks read.
ENDED_FIELDS = ("status", "finish_reason", "batch_id", "created_at", *STAGE_TIMES, *ATTEMPT_FIELDS)

# A status move. KEYS: job hash, live set, finished channel. ARGV from ``o``: status, allowed from
# (comma-separated, '' any), '1' if terminal, job id, then field, value pairs up to ARGV[last].
_MOVE = """
local function move(o)
  local cur = redis.call('HGET', KEYS[1], 'status')
  if not cur then return -1 end
  if cur == 'completed' or cur == 'failed' or cur == 'cancelled' or cur == 'timed_out' then return 0 end
  if ARGV[o + 1] ~= '' then
    local ok = false
    for s in string.gmatch(ARGV[o + 1], '[^,]+') do if s == cur then ok = true end end
    if not ok then return 0 end
  end
  redis.call('HSET', KEYS[1], 'status', ARGV[o], unpack(ARGV, o + 4, last))
  if ARGV[o + 2] == '1' then
    redis.call('SREM', KEYS[2], ARGV[o + 3])
    redis.call('PUBLISH', KEYS[3], ARGV[o + 3])
    return redis.call('HMGET', KEYS[1], ENDED_FIELDS)
  end
  return 1
end
""".replace("ENDED_FIELDS", ", ".join(f"'{name}'" for name in ENDED_FIELDS))

TRANSITION = "local last = #ARGV\n" + _MOVE + "return move(1)"

# Everything a stage checks and records before its body, in one round trip, as a Lua function other
# scripts can begin with (backends.py: the run stage's begin with its first LLM call).
# KEYS: job hash, job lease. ARGV: previous status, stage status, lease owner, lease ttl ms,
# attempts field, start field, now, end field (a stage that already ended never runs again),
# a status the stage may also begin from ('' none) and the field stamped then (the run stage of a
# job that skipped init: it begins from queued and stamps init_start), the recovery field (the
# delivery count housekeeping found lost: a stage some worker began is taken over only by that
# recovery, never by a duplicate message while its holder may still renew its lease). The same
# owner beginning again (its reply lost to a Redis restart) gets the same answer. Returns its
# answer and the job's fields it read (the 7th: the model of the job's first call).
BEGIN_STAGE_FUNCTION = """
local function begin_stage()
  local f = redis.call('HMGET', KEYS[1], 'status', 'cancel_requested', 'deadline_at', 'rollout_index', ARGV[8],
                       ARGV[5], 'first_call_model', ARGV[11])
  if not f[1] then return {'missing'} end
  local skipped = f[1] == ARGV[9]
  if (f[1] ~= ARGV[1] and f[1] ~= ARGV[2] and not skipped) or f[5] then return {'skip', f[1]} end
  if f[2] == '1' then return {'cancelled'} end
  if f[1] == ARGV[2] then
    local held = redis.call('GET', KEYS[2])
    if held == ARGV[3] then return {'ok', f[3], tonumber(f[6] or '0'), f[4] or '0'}, f end
    if held or f[8] ~= (f[6] or '0') then return {'leased'} end
  end
  if not redis.call('SET', KEYS[2], ARGV[3], 'NX', 'PX', ARGV[4]) then return {'leased'} end
  local attempts = tonumber(f[6] or '0') + 1
  if skipped then redis.call('HSET', KEYS[1], 'status', ARGV[2], ARGV[5], attempts, ARGV[6], ARGV[7], ARGV[10], ARGV[7])
  else redis.call('HSET', KEYS[1], 'status', ARGV[2], ARGV[5], attempts, ARGV[6], ARGV[7]) end
  return {'ok', f[3], attempts, f[4] or '0'}, f
end
"""
BEGIN_STAGE_ARGS = 11  # a script that begins with begin_stage() reads its own ARGV after these
BEGIN_STAGE = BEGIN_STAGE_FUNCTION + "local begun = begin_stage()\nreturn begun"

# A stage's end: its lease released, then its fields set: the status after. KEYS: job hash, lease.
# ARGV: lease owner, then field, value pairs up to ARGV[last].
_END_STAGE = """
local function end_stage()
  if redis.call('GET', KEYS[2]) == ARGV[1] then redis.call('DEL', KEYS[2]) end
  if last > 1 then redis.call('HSET', KEYS[1], unpack(ARGV, 2, last)) end
  return redis.call('HGET', KEYS[1], 'status')
end
"""

# A stage's end with a move first: {what TRANSITION answers, the status after}. KEYS: job hash, live
# set, finished channel, lease. ARGV: lease owner, n, n args of field, value pairs, the move's ARGV
# (whose field, value pairs end with the same n: a move sets them with its own).
_MOVE_AND_END_STAGE = (
    _MOVE
    + """
local function move_and_end()
  local n = tonumber(ARGV[2])
  local moved = move(n + 3)
  if redis.call('GET', KEYS[4]) == ARGV[1] then redis.call('DEL', KEYS[4]) end
  if moved == -1 then return {moved, false} end
  if moved ~= 0 then return {moved, ARGV[n + 3]} end
  if n > 0 then redis.call('HSET', KEYS[1], unpack(ARGV, 3, n + 2)) end
  return {moved, redis.call('HGET', KEYS[1], 'status')}
end
"""
)


def stage_end_scripts(then: str = "", then_args: int = 0) -> tuple[str, str]:
    """The scripts that end a stage: plain, and with a move first. ``then``: Lua the script runs
    after the end (``then_args`` more ARGV, after the end's own, from ``ARGV[last + 1]``)."""
    head = f"local last = #ARGV - {then_args}\n"
    return (
        head + _END_STAGE + f"local answer = end_stage()\n{then}\nreturn answer",
        head + _MOVE_AND_END_STAGE + f"local answer = move_and_end()\n{then}\nreturn answer",
    )


END_STAGE, MOVE_AND_END_STAGE = stage_end_scripts()

# A lease renewed; one that lapsed (Redis restarted, or the holder stalled) is taken again while
# its stage is still the job's and nobody else took it. KEYS: lease, job hash. ARGV: owner, ttl ms,
# the stage's status, its end field. Returns 1 (held), 0 (lost: another delivery holds the stage,
# or it is over).
RENEW_LEASE = """
local held = redis.call('GET', KEYS[1])
if held == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if held then return 0 end
local f = redis.call('HMGET', KEYS[2], 'status', ARGV[4])
if f[1] ~= ARGV[3] or f[2] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# A stage that gives its job back for another delivery (Redis was away longer than its commands
# wait): the recovery field set to this delivery's count, so that the next begin takes the stage
# over, and the lease released. KEYS: job hash, lease. ARGV: owner, recovery field, delivery count.
HAND_BACK = """
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
if redis.call('GET', KEYS[2]) == ARGV[1] then redis.call('DEL', KEYS[2]) end
return 1
"""
