"""The data plane's Lua scripts (run by the streams' sides and `dataplane.registry`), rendered once at import.

Each declares every key it touches in KEYS, binds its fixed KEYS and ARGV to named locals first, and names every
field, state and reply through `keys.lua` placeholders (`'${HeartbeatField.STATE}'`), never spelled here.
"""

from rollout_svc.dataplane.levels import COST_LUA, LOADS_LUA, with_levels
from rollout_svc.keys import lua

# KEYS: [1] the loads hash, [2] `Keys.levels`, [3] `Keys.open_at`, then the streams named (results and requests
# streams), each once. ARGV: [1] results ttl s, [2] group, [3] the worker's id, [4] its free slots after this publish
# ('' to leave them and its load), [5] tokens its reads took that no script counted yet (signed: a take's read
# beyond or short of its plan), [6] the part of them read from its pinned stream (both `workers.inflight.Woken`),
# then 5 per item: results key index (0: no result),
# payload, requests key index, entry id, its cost. The load (`Keys.loads` ID) gets [5] less the items' costs,
# ID:pinned loses [6], the queued tokens the rest of [5]; none goes below 0. Its level follows (`dataplane.levels`).
# An item's result is added only if its XACK returned 1, that is if the entry was still pending here; 0 means it was
# requeued while this worker was presumed dead, and the worker that takes the requeued copy answers it. The acked
# entries are deleted with one XDEL a stream. Returns the positions (1-based) of the items fenced.
PUBLISH_LUA = with_levels("""
local results_ttl_s, group, worker, free = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local fenced, touched, done, acked = {}, {}, 0, {}
for a = 7, #ARGV, 5 do
  local stream, id = KEYS[tonumber(ARGV[a + 2])], ARGV[a + 3]
  done = done + tonumber(ARGV[a + 4])
  if redis.call('XACK', stream, group, id) == 1 then
    local ids = acked[stream] or {}
    acked[stream], ids[#ids + 1] = ids, id
    local r = tonumber(ARGV[a])
    if r > 0 then
      redis.call('XADD', KEYS[r], '*', '${PAYLOAD_FIELD}', ARGV[a + 1])
      touched[KEYS[r]] = true
    end
  else
    fenced[#fenced + 1] = (a - 2) / 5
  end
end
for stream, ids in pairs(acked) do  -- deleted once answered: one XDEL a stream
  for i = 1, #ids, 1000 do redis.call('XDEL', stream, unpack(ids, i, math.min(i + 999, #ids))) end
end
for key in pairs(touched) do redis.call('EXPIRE', key, results_ttl_s) end
if free ~= '' then  -- its fields read once and written once (`own_loads`, `settle`), its level from them
  local woken, woken_pinned = tonumber(ARGV[5]), tonumber(ARGV[6])
  local h = own_loads(L, worker)
  local load, pinned = math.max(0, num(h[1]) + woken - done), math.max(0, num(h[2]) - woken_pinned)
  local queued = math.max(0, num(h[3]) + woken_pinned - woken)
  settle(L, worker, h, load, pinned, queued, tonumber(free) > 0, 0)  -- no clock read unless it joins: takes stamp it
end
return fenced
""")

# KEYS: [1] the loads hash, [2] `Keys.levels`, [3] `Keys.open_at`. ARGV: [1] the worker's id, [2] its free slots
# (0 while it takes nothing: paused, draining), [3] what its engine holds, "kv-cache-tokens max-model-len" ('': not
# known yet). Records them, leaving its load as it is: its level (`dataplane.levels`: open while it has a free
# slot, stamped with Redis's clock), and the widest and narrowest contexts said so far
# (fields *:holds and *:narrowest; they never narrow or widen: a wider worker gone leaves the narrower ones taking by
# share alone). Returns the widest.
REPORT_LOAD_LUA = with_levels("""
local loads, worker, free = KEYS[1], ARGV[1], ARGV[2]
local at = now_ms()
local contexts = redis.call('HMGET', loads, '${WIDEST_FIELD}', '${NARROWEST_FIELD}')
local widest, narrowest = num(contexts[1]), num(contexts[2])
if ARGV[3] and ARGV[3] ~= '' then
  redis.call('HSET', loads, worker .. '${HOLDS_SUFFIX}', ARGV[3])
  local ctx = num(string.match(ARGV[3], ' (%d+)$$'))
  if ctx > widest then
    widest = ctx
    redis.call('HSET', loads, '${WIDEST_FIELD}', ctx)
  end
  if ctx > 0 and (narrowest == 0 or ctx < narrowest) then redis.call('HSET', loads, '${NARROWEST_FIELD}', ctx) end
end
relevel(L, worker, tonumber(free) > 0, at)
return widest
""")

# KEYS: [1] the loads hash, [2] `Keys.levels`, [3] `Keys.open_at`. ARGV: [1] a departed worker's id. Closes it
# (`dataplane.levels`) and deletes its fields (load, pinned tokens, holdings).
FORGET_LOAD_LUA = with_levels("""
local id = ARGV[1]
relevel(L, id, false)
redis.call('HDEL', L.loads, id, id .. '${PINNED_SUFFIX}', id .. '${HOLDS_SUFFIX}')
return 1
""")


# KEYS: [1] the entry's stream, [2] the dead-letter stream, [3] the producer's results stream (or [2] again).
# ARGV: [1] group, [2] entry id, [3] dead-letter maxlen, [4] results ttl s, [5] reply payload or '', then the dead
# letter's field/value pairs. Fenced like a publish. Returns 1, or 0 if the entry was no longer pending here.
DEAD_LETTER_LUA = lua("""
local stream, dead, results = KEYS[1], KEYS[2], KEYS[3]
local group, id, maxlen, results_ttl_s, reply = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
if redis.call('XACK', stream, group, id) == 0 then return 0 end
redis.call('XDEL', stream, id)
redis.call('XADD', dead, 'MAXLEN', '~', maxlen, '*', unpack(ARGV, 6))
if reply ~= '' then
  redis.call('XADD', results, '*', '${PAYLOAD_FIELD}', reply)
  redis.call('EXPIRE', results, results_ttl_s)
end
return 1
""")

# KEYS: [1] a requests stream, [2] the loads hash, [3] `Keys.queued_costs`, then results streams. ARGV: [1] group,
# [2] results ttl s, [3] 1 if [1] is the shared stream (what it deletes is taken off the queued tokens and costs),
# then 3 per entry (entry id, results key index or 0, result payload). Deletes each entry that is still undelivered
# (it exists and no consumer holds it) and answers it; an entry a worker took meanwhile is that worker's to answer.
SWEEP_LUA = (
    COST_LUA
    + LOADS_LUA
    + lua("""
local stream, group, results_ttl_s = KEYS[1], ARGV[1], ARGV[2]
local swept, unqueued = {}, 0
for a = 4, #ARGV, 3 do
  local id = ARGV[a]
  local found = redis.call('XRANGE', stream, id, id)
  if #found == 1 then
    local ok, pending = pcall(redis.call, 'XPENDING', stream, group, id, id, 1)
    if not ok or #pending == 0 then
      redis.call('XDEL', stream, id)
      local fields, cost = found[1][2], 1  -- as the enqueue script counted it
      for i = 1, #fields, 2 do
        if fields[i] == '${COST_FIELD}' then cost = clamp_cost(fields[i + 1]) end
      end
      unqueued = unqueued + cost
      if ARGV[3] == '1' then redis.call('LREM', KEYS[3], 1, string.format('%s %d', id, cost)) end
      local r = tonumber(ARGV[a + 1])
      if r > 0 then
        redis.call('XADD', KEYS[r], '*', '${PAYLOAD_FIELD}', ARGV[a + 2])
        redis.call('EXPIRE', KEYS[r], results_ttl_s)
      end
      swept[#swept + 1] = id
    end
  end
end
if ARGV[3] == '1' then add_to_load(KEYS[2], '${QUEUED_FIELD}', -unqueued) end
return swept
""")
)

# KEYS: [1] a requests stream. ARGV: [1] group, [2] consumer. Deletes the consumer only if it holds no pending entry:
# XGROUP DELCONSUMER drops a consumer's pending entries with it, and an entry dropped so (not acked, not deleted,
# before the group's last-delivered id) is never delivered again. Returns 1 if the consumer is gone (or the group
# is), 0 if it still holds entries (delivered to it after they were requeued: a worker reaped while it lived).
FORGET_CONSUMER_LUA = lua("""
local stream, group, consumer = KEYS[1], ARGV[1], ARGV[2]
local ok, pending = pcall(redis.call, 'XPENDING', stream, group, '-', '+', 1, consumer)
if not ok then return 1 end
if #pending > 0 then return 0 end
redis.call('XGROUP', 'DELCONSUMER', stream, group, consumer)
return 1
""")

# KEYS: [1] heartbeat hash, [2] workers set. ARGV: [1] ttl ms, [2] worker id, [3] '1' to renew only (the hash must
# still exist: if it expired, this worker was presumed dead and may have been reaped, so it must not come back
# under this id), [4] channel to announce on or '', [5] announcement, then the hash's field/value pairs
# (`WorkerStatus.to_hash`). Returns 1, or 0 if a renewal was refused.
HEARTBEAT_LUA = lua("""
local heartbeat, workers = KEYS[1], KEYS[2]
local ttl_ms, worker_id, renew, channel, announcement = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
if renew == '1' and redis.call('EXISTS', heartbeat) == 0 then return 0 end
redis.call('HSET', heartbeat, unpack(ARGV, 6))
redis.call('PEXPIRE', heartbeat, ttl_ms)
redis.call('SADD', workers, worker_id)
if channel ~= '' then redis.call('PUBLISH', channel, announcement) end
return 1
""")

# KEYS: [1] a reap lock. ARGV: [1] its holder, [2] its TTL in ms. Takes the lock if it is free, or renews it if this
# holder holds it already (a reap cut short by a Redis restart left it held by the reaper that retries); 1 if held.
RETAKE_LOCK_LUA = lua("""
local lock, holder, ttl = KEYS[1], ARGV[1], ARGV[2]
if redis.call('SET', lock, holder, 'NX', 'PX', ttl) then return 1 end
if redis.call('GET', lock) == holder then redis.call('PEXPIRE', lock, ttl) return 1 end
return 0
""")

# KEYS: [1] a reap lock. ARGV: [1] its holder. Deletes the lock only if that holder still holds it.
RELEASE_LOCK_LUA = lua("""
local lock, holder = KEYS[1], ARGV[1]
if redis.call('GET', lock) == holder then return redis.call('DEL', lock) end
return 0
""")
