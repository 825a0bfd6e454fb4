"""The data plane's Lua scripts (run by the streams' sides and `dataplane.registry`), rendered once at import.

Each declares every key it touches in KEYS, binds its fixed KEYS and ARGV to named locals first, and names every
field, state and reply through `keys.lua` placeholders (`'${HeartbeatField.STATE}'`), never spelled here.
"""

from rollout_svc.keys import lua

# Shared by the placement and take scripts: a request's cost in tokens as every script counts it, from its cost field
# or argument: at most `MAX_COST`, and 1 for anything that is not a number of at least 1 (absent, '0', garbage).
_COST_LUA = lua("""
local function clamp_cost(value)
  local c = tonumber(value)  -- nil for garbage; nan fails every comparison
  if not c or not (c >= 1) then return 1 end
  return math.min(math.floor(c), ${MAX_COST})
end
""")

# Shared by the take and publish scripts: add `tokens` (negative: take off) to a field of the loads hash
# (`Keys.loads`: a worker's load, or its ID:pinned), never leaving it below 0.
_LOADS_LUA = lua("""
local function add_to_load(loads, field, tokens)
  local left = (tonumber(redis.call('HGET', loads, field) or '0') or 0) + tokens
  redis.call('HSET', loads, field, math.max(0, left))
end
""")

# Shared by the publish and load report scripts: stamp a worker's free slots in the loads hash (`Keys.loads`
# ID:free, "free-slots at-ms") with Redis's clock, which the take script reads them by (a worker host's clock may
# be off).
_FREE_LUA = lua("""
local function stamp_free(loads, worker, free)
  local t = redis.call('TIME')
  local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('HSET', loads, worker .. '${FREE_SUFFIX}', string.format('%d %d', free, now_ms))
end
""")

# Shared by the placement scripts. fleet_at(kf, af): the fleet block of KEYS from index kf (Keys.fleet: state,
# workers set, loads hash, then heartbeat, session set and pinned stream per worker) and of ARGV from index af (the
# worker count, then the ids). place(): a live pin stays unless its worker sleeps, drains (kept for a forward) or is
# stale; otherwise the preferred worker, if serving or paused, takes the session; otherwise the converged (applied the
# current epoch) serving or paused worker with the least work: the tokens it holds (`Keys.loads` ID) plus those placed
# in its pinned stream and not taken yet (ID:pinned; `queued` counts a request placed there, `count_queued` adds this
# call's to it), then the fewest unexpired sessions, then the lowest id. No such worker: false (the shared stream).
_FLEET_LUA = _COST_LUA + lua("""
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function fleet_at(kf, af)
  local f = {state = KEYS[kf], set = KEYS[kf + 1], loads = KEYS[kf + 2], ids = {}, hb = {}, zs = {}, pinned = {},
             placed = {}}
  local n = tonumber(ARGV[af])
  for i = 1, n do
    local id, k = ARGV[af + i], kf + 3 + 3 * (i - 1)
    f.ids[i] = id
    f.hb[id], f.zs[id], f.pinned[id] = KEYS[k], KEYS[k + 1], k + 2
  end
  f.next_key, f.next_arg = kf + 3 + 3 * n, af + n + 1
  return f
end
local function tokens_of(f, field)
  local v = tonumber(redis.call('HGET', f.loads, field) or '0')  -- nil for garbage
  if not v or not (v > 0) then return 0 end
  return v
end
local function queued(f, w, cost)  -- a request of `cost` tokens placed in w's pinned stream
  f.placed[w] = (f.placed[w] or 0) + clamp_cost(cost)
end
local function count_queued(f)  -- what `queued` placed, added to ID:pinned (once the call is admitted)
  for w, c in pairs(f.placed) do redis.call('HINCRBY', f.loads, w .. '${PINNED_SUFFIX}', c) end
end
local function stale(f)
  if redis.call('SCARD', f.set) ~= #f.ids then return true end
  for _, id in ipairs(f.ids) do
    if redis.call('SISMEMBER', f.set, id) == 0 then return true end
  end
  return false
end
local function epoch_of(f) return tonumber(redis.call('HGET', f.state, '${StateField.EPOCH}') or '0') end
local function place(f, epoch, ttl_ms, skey, sid, preferred, keep_draining)
  local function pin(w)
    redis.call('SET', skey, w, 'PX', ttl_ms)
    redis.call('ZADD', f.zs[w], now_ms + ttl_ms, sid)
    return w
  end
  local w = redis.call('GET', skey)
  if w and f.hb[w] then
    local state = redis.call('HGET', f.hb[w], '${HeartbeatField.STATE}')
    if state and state ~= '${WorkerLabel.SLEEPING}' and state ~= '${WorkerLabel.STALE}'
        and (state ~= '${WorkerLabel.DRAINING}' or keep_draining) then
      return pin(w)
    end
    redis.call('ZREM', f.zs[w], sid)
  end
  if w then redis.call('DEL', skey) end
  if preferred and f.hb[preferred] then
    local state = redis.call('HGET', f.hb[preferred], '${HeartbeatField.STATE}')
    if state == '${WorkerLabel.SERVING}' or state == '${WorkerLabel.PAUSED}' then return pin(preferred) end
  end
  local best, best_load, best_sessions = false, 0, 0
  for _, id in ipairs(f.ids) do
    local h = redis.call('HMGET', f.hb[id], '${HeartbeatField.STATE}', '${HeartbeatField.APPLIED_EPOCH}')
    if (h[1] == '${WorkerLabel.SERVING}' or h[1] == '${WorkerLabel.PAUSED}') and tonumber(h[2] or '0') >= epoch then
      redis.call('ZREMRANGEBYSCORE', f.zs[id], '-inf', now_ms)
      local sessions = redis.call('ZCARD', f.zs[id])
      local load = tokens_of(f, id) + tokens_of(f, id .. '${PINNED_SUFFIX}') + (f.placed[id] or 0)
      if not best or load < best_load or (load == best_load and (sessions < best_sessions
          or (sessions == best_sessions and id < best))) then
        best, best_load, best_sessions = id, load, sessions
      end
    end
  end
  if best then return pin(best) end
  return false
end
""")

# KEYS: [1] shared requests stream, [2] token requests stream, the fleet from [3], then one session key per
# session item, then the streams of the entries to ack. ARGV: [1] session ttl ms, [2] limit (-1: none), [3] group,
# [4] worker count, worker ids, then the item count and 4 per item (kind, session id or '', cost in tokens or 0,
# payload), then the ack
# count and 2 per ack (key index, entry id). The kind is an `EnqueueKind` ('g' rollout request, 't' tokenize), and for
# a requeue 'g DELIVERIES EPOCH' (a new request gets the current epoch, as does an empty EPOCH, and no delivery count);
# 'f' (a forward, `EnqueueKind.FORWARD`, as 'g' otherwise) keeps its session's pin to a worker that drains.
# Returns (`ScriptReply`) {'stale'}, {'full', stream, length} or {'ok', entry id per item, then the target key index of
# each session item}.
# Placement happens before the admission check, so a refused chunk may still have pinned its sessions: harmless,
# the pins expire.
ENQUEUE_LUA = _FLEET_LUA + lua("""
local shared, tokens = 1, 2  -- the KEYS indices of the shared and the token requests streams
local ttl_ms, limit, group = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local f = fleet_at(3, 4)
if stale(f) then return {'${ScriptReply.STALE}'} end
local epoch = tostring(epoch_of(f))
local k, a = f.next_key, f.next_arg
local n = tonumber(ARGV[a])
local first = a + 1
local targets, counts, placed = {}, {}, {}
for i = 1, n do
  local at = first + 4 * (i - 1)
  local target = shared
  if ARGV[at] == '${EnqueueKind.TOKENS}' then
    target = tokens
  elseif ARGV[at + 1] ~= '' then
    local w = place(f, tonumber(epoch), ttl_ms, KEYS[k], ARGV[at + 1], false,
      string.sub(ARGV[at], 1, 1) == '${EnqueueKind.FORWARD}')
    k = k + 1
    if w then
      target = f.pinned[w]
      queued(f, w, ARGV[at + 2])
    end
    placed[#placed + 1] = target
  end
  targets[i] = target
  counts[target] = (counts[target] or 0) + 1
end
if limit >= 0 then
  for target, c in pairs(counts) do
    local len = redis.call('XLEN', KEYS[target])
    if len + c > limit then return {'${ScriptReply.FULL}', KEYS[target], len} end
  end
end
count_queued(f)
local reply = {'${ScriptReply.OK}'}
for i = 1, n do
  local at = first + 4 * (i - 1)
  local kind, sid, key = ARGV[at], ARGV[at + 1], KEYS[targets[i]]
  local e, d = epoch, '0'
  if #kind > 1 then
    d, e = string.match(kind, '^%a (%d+) (%d*)$$')
    if e == '' then e = epoch end
  end
  local fields = {'${PAYLOAD_FIELD}', ARGV[at + 3], '${EPOCH_FIELD}', e}
  if sid ~= '' then fields[#fields + 1], fields[#fields + 2] = '${SESSION_FIELD}', sid end
  if d ~= '0' then fields[#fields + 1], fields[#fields + 2] = '${DELIVERIES_FIELD}', d end
  if ARGV[at + 2] ~= '0' then fields[#fields + 1], fields[#fields + 2] = '${COST_FIELD}', ARGV[at + 2] end
  local id = redis.call('XADD', key, '*', unpack(fields))
  reply[i + 1] = id
end
for _, target in ipairs(placed) do reply[#reply + 1] = target end
a = first + 4 * n
for _ = 1, tonumber(ARGV[a]) do
  local key, id = KEYS[tonumber(ARGV[a + 1])], ARGV[a + 2]
  redis.call('XACK', key, group, id)
  redis.call('XDEL', key, id)
  a = a + 2
end
return reply
""")

# KEYS: the fleet, then the session key. ARGV: session ttl ms, worker count, worker ids, session id, worker id.
# A worker that took a session's request from the shared stream pins the session to itself unless a live
# worker holds it (one that drains too: it may be running a request of the session; the caller forwards the
# request to it, `EnqueueKind.FORWARD`). Returns {'stale'} or {'ok', the pinned worker or ''}.
PIN_LUA = _FLEET_LUA + lua("""
local ttl_ms = tonumber(ARGV[1])
local f = fleet_at(1, 2)
if stale(f) then return {'${ScriptReply.STALE}'} end
local skey, sid, worker_id = KEYS[f.next_key], ARGV[f.next_arg], ARGV[f.next_arg + 1]
local w = place(f, epoch_of(f), ttl_ms, skey, sid, worker_id, true)
return {'${ScriptReply.OK}', w or ''}
""")

# KEYS: the fleet, then the session key. ARGV: worker count, worker ids, session id. Unpins a session so its
# next turn is placed anew. Returns {'stale'} or {'ok', 1 if it was pinned}.
FINISH_SESSION_LUA = _FLEET_LUA + lua("""
local f = fleet_at(1, 1)
if stale(f) then return {'${ScriptReply.STALE}'} end
local skey, sid = KEYS[f.next_key], ARGV[f.next_arg]
local w = redis.call('GET', skey)
if w and f.zs[w] then redis.call('ZREM', f.zs[w], sid) end
return {'${ScriptReply.OK}', redis.call('DEL', skey)}
""")

# KEYS: [1] the loads hash, then the streams named (results and requests streams), each once. ARGV: [1] results ttl
# s, [2] group, [3] the worker's id, [4] its free slots after this publish ('' to leave them and its load), [5] tokens
# its blocking reads took that no take counted yet, [6] the part of them read from its pinned stream (both
# `workers.inflight.Woken`), then 5 per item: results key index (0: no result), payload, requests key index, entry id,
# its cost. The load (`Keys.loads` ID) gets [5] less the items' costs, ID:pinned loses [6]; neither goes below 0.
# An item's result is added only if its XACK returned 1, that is if the entry was still pending here; 0 means it was
# requeued while this worker was presumed dead, and the worker that takes the requeued copy answers it. Returns how
# many were fenced.
PUBLISH_LUA = (
    _LOADS_LUA
    + _FREE_LUA
    + lua("""
local results_ttl_s, group, worker, free = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local fenced, touched, done = 0, {}, 0
for a = 7, #ARGV, 5 do
  local stream, id = KEYS[tonumber(ARGV[a + 2])], ARGV[a + 3]
  done = done + tonumber(ARGV[a + 4])
  if redis.call('XACK', stream, group, id) == 1 then
    redis.call('XDEL', stream, id)
    local r = tonumber(ARGV[a])
    if r > 0 then
      redis.call('XADD', KEYS[r], '*', '${PAYLOAD_FIELD}', ARGV[a + 1])
      touched[KEYS[r]] = true
    end
  else
    fenced = fenced + 1
  end
end
for key in pairs(touched) do redis.call('EXPIRE', key, results_ttl_s) end
if free ~= '' then
  local woken = tonumber(ARGV[5])
  if done ~= woken then add_to_load(KEYS[1], worker, woken - done) end
  if tonumber(ARGV[6]) > 0 then add_to_load(KEYS[1], worker .. '${PINNED_SUFFIX}', -tonumber(ARGV[6])) end
  stamp_free(KEYS[1], worker, free)
end
return fenced
""")
)

# KEYS: [1] the loads hash. ARGV: [1] the worker's id, [2] its free slots (0 while it takes nothing: paused,
# draining), [3] what its engine holds, "kv-cache-tokens max-model-len" ('': not known yet). Records them, the free
# slots stamped with Redis's clock (`stamp_free`), leaving its load as it is, and the widest context said so far
# (field *:holds; it never narrows: a wider worker gone leaves the narrower ones taking by share alone). Returns it.
REPORT_LOAD_LUA = _FREE_LUA + lua("""
local loads, worker, free = KEYS[1], ARGV[1], ARGV[2]
stamp_free(loads, worker, free)
local widest = tonumber(redis.call('HGET', loads, '${WIDEST_FIELD}') or '0') or 0
if ARGV[3] and ARGV[3] ~= '' then
  redis.call('HSET', loads, worker .. '${HOLDS_SUFFIX}', ARGV[3])
  local ctx = tonumber(string.match(ARGV[3], ' (%d+)$$') or '0')
  if ctx > widest then
    widest = ctx
    redis.call('HSET', loads, '${WIDEST_FIELD}', ctx)
  end
end
return widest
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

# KEYS: [1] a requests stream, then results streams. ARGV: [1] group, [2] results ttl s, then 3 per entry (entry
# id, results key index or 0, result payload). Deletes each entry that is still undelivered (it exists and no
# consumer holds it) and answers it; an entry a worker took meanwhile is that worker's to answer.
SWEEP_LUA = lua("""
local stream, group, results_ttl_s = KEYS[1], ARGV[1], ARGV[2]
local swept = {}
for a = 3, #ARGV, 3 do
  local id = ARGV[a]
  if #redis.call('XRANGE', stream, id, id) == 1 then
    local ok, pending = pcall(redis.call, 'XPENDING', stream, group, id, id, 1)
    if not ok or #pending == 0 then
      redis.call('XDEL', stream, id)
      local r = tonumber(ARGV[a + 1])
      if r > 0 then
        redis.call('XADD', KEYS[r], '*', '${PAYLOAD_FIELD}', ARGV[a + 2])
        redis.call('EXPIRE', KEYS[r], results_ttl_s)
      end
      swept[#swept + 1] = id
    end
  end
end
return swept
""")

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

# A worker's take of rollout requests, non-blocking, by fair share of the work (`WorkerStreams.take`).
# KEYS: [1] its pinned stream, [2] the shared stream, [3] the loads hash (`Keys.loads`: per worker, field ID holds
# the tokens it holds, added here and taken off by its publishes, field ID:free "free-slots at-ms", and ID:pinned the
# tokens placed in its pinned stream not yet taken, taken off here).
# ARGV: [1] group, [2] worker id, [3] free slots, [4] loads TTL ms, [5] the most queued entries it peeks at, [6] tokens
# it took outside (its blocking read of the next entry), added to its load, [7] 1 if it holds nothing (its load is
# then 0: a request that left it other than by a publish, requeued or forwarded, would otherwise count for ever),
# [8] 1 to share (placement `cost`), 0 to take whatever fits (`fifo`), [9] the part of [6] read from its pinned
# stream (taken off ID:pinned first), [10] its engine's KV cache and [11] its context, in tokens (0: not known).
# 1. Its pinned entries (its sessions), up to its free slots (ID:pinned less their cost, or 0 once none is left).
# 2. Of the shared queue, the share that brings its load to the level the open workers' loads would reach if the
# queued work were spread over them in proportion to their KV caches (water level: queued tokens plus their loads,
# over their caches, `ID:holds`; over their number while one has not said its cache); open = said within the TTL
# that it has a free slot, itself included. It stops at an entry costing more than its context that another open
# worker's context holds (a long-context request goes where it fits; one that fits nowhere is taken as before).
# At least one entry if it is the least loaded open worker, so nothing waits while it has room. A queue as deep as
# the open workers' free slots (or the peek limit) is not shared: it takes up to its free slots. 3. Its load.
# Returns the entries as XREADGROUP does: {stream, {{id, fields}, ...}} per stream with entries, then 'left' if it
# left queued entries to other workers' shares (the caller then waits for a slot of its own, not for new entries).
TAKE_LUA = (
    _COST_LUA
    + _LOADS_LUA
    + lua("""
local pinned, shared, loads = KEYS[1], KEYS[2], KEYS[3]
local group, me, free = ARGV[1], ARGV[2], tonumber(ARGV[3])
local ttl_ms, peek = tonumber(ARGV[4]), tonumber(ARGV[5])
local kv_me, ctx_me = tonumber(ARGV[10] or '0') or 0, tonumber(ARGV[11] or '0') or 0
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local reply, left, spent = {}, false, tonumber(ARGV[6])
local suffix_free = '${FREE_SUFFIX}'
local held = math.max(0, tonumber(redis.call('HGET', loads, me) or '0'))
if tonumber(ARGV[9]) > 0 then add_to_load(loads, me .. '${PINNED_SUFFIX}', -tonumber(ARGV[9])) end
if ARGV[7] == '1' then
  held = 0
  redis.call('HSET', loads, me, 0)
end
local function cost_of(fields)
  for i = 1, #fields, 2 do
    if fields[i] == '${COST_FIELD}' then return clamp_cost(fields[i + 1]) end
  end
  return 1
end
local function take(stream, count)
  local r = redis.call('XREADGROUP', 'GROUP', group, me, 'COUNT', count, 'STREAMS', stream, '${StreamSyntax.NEW}')
  if not r or not r[1] then return end
  local read = r[1][2] and r[1] or r  -- {{stream, entries}}; fakeredis (the `up` fallback): flat
  for _, e in ipairs(read[2]) do spent = spent + cost_of(e[2]) end
  reply[#reply + 1] = {read[1], read[2]}
  free = free - #read[2]
end
-- 1. pinned, and what it leaves there (ID:pinned, which placement adds to): 0 once nothing new is left in it, so a
-- count that missed an entry (one taken by the blocking read, or moved out by a reaper) is set right
if free > 0 then
  local before = spent
  take(pinned, free)
  if free > 0 then
    redis.call('HSET', loads, me .. '${PINNED_SUFFIX}', 0)
  elseif spent > before then
    add_to_load(loads, me .. '${PINNED_SUFFIX}', before - spent)
  end
end
-- 2. shared: the queue ahead of the group (nothing: done, the common case of an idle fleet), then the open workers'
-- loads and its share
local function ahead_of_group()
  local last = '${StreamSyntax.FIRST_ID}'
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', shared)) do
    local info = {}
    for i = 1, 11, 2 do  -- not #g: a null field (entries-read) may end the table early under fakeredis
      if g[i] then info[g[i]] = g[i + 1] end
    end
    if info['${StreamSyntax.GROUP_NAME}'] == group then last = info['${StreamSyntax.LAST_DELIVERED_ID}'] end
  end
  return '${StreamSyntax.EXCLUSIVE}' .. last
end
local after = free > 0 and redis.call('EXISTS', shared) == 1 and ahead_of_group()
if after and #redis.call('XRANGE', shared, after, '+', 'COUNT', 1) > 0 then
  local mine = held + spent
  local h = redis.call('HGETALL', loads)
  local raw, others = {}, {}
  for i = 1, #h, 2 do raw[h[i]] = h[i + 1] end
  for i = 1, #h, 2 do
    local id = string.sub(h[i], -#suffix_free) == suffix_free and string.sub(h[i], 1, -#suffix_free - 1)
    if id and id ~= me then
      local slots, at = string.match(h[i + 1], '^(%d+) (%d+)$$')
      if slots and tonumber(slots) > 0 and tonumber(at) + ttl_ms >= now_ms then others[#others + 1] = id end
    end
  end
  local function holds_of(id)  -- its engine's KV cache and context in tokens (0 0: not said)
    local kv, ctx = string.match(raw[id .. '${HOLDS_SUFFIX}'] or '', '^(%d+) (%d+)$$')
    return tonumber(kv or '0'), tonumber(ctx or '0')
  end
  -- each open worker's weight: its KV cache where every one said it (work in proportion to it), else 1 each; the
  -- widest context among the others (unsaid: any), to leave them what only they can hold
  local weighted, widest = kv_me > 0, 0
  for _, id in ipairs(others) do
    local kv, ctx = holds_of(id)
    if kv == 0 then weighted = false end
    widest = math.max(widest, ctx == 0 and math.huge or ctx)
  end
  local w_me = weighted and kv_me or 1
  local open, level_sum, weight_sum, least = 1, mine, w_me, true
  for _, id in ipairs(others) do
    local load, w = math.max(0, tonumber(raw[id] or '0') or 0), weighted and holds_of(id) or 1
    open, level_sum, weight_sum = open + 1, level_sum + load, weight_sum + w
    if load / w < mine / w_me or (load / w == mine / w_me and id < me) then least = false end
  end
  local function fits(c)  -- false: another open worker's context holds it and mine does not: left to it
    return ctx_me == 0 or c <= ctx_me or c > widest
  end
  local enough = math.min(free * open, peek)  -- a queue this deep fills every open worker
  local ahead = redis.call('XRANGE', shared, after, '+', 'COUNT', enough)
  local count = 0
  if #ahead >= enough or ARGV[8] == '0' then
    count = free
    for i, e in ipairs(ahead) do
      if i > free then break end
      if not fits(cost_of(e[2])) then count, left = i - 1, true break end
    end
  elseif #ahead > 0 then
    local queued = 0
    for _, e in ipairs(ahead) do queued = queued + cost_of(e[2]) end
    local budget = (queued + level_sum) * w_me / weight_sum - mine
    for _, e in ipairs(ahead) do
      local c = cost_of(e[2])
      -- past its share only what its context holds and no other open worker's does
      local only_mine = (ctx_me == 0 or c <= ctx_me) and c > widest
      local over_share = budget < c / 2 and not (count == 0 and least) and not only_mine
      if count >= free or not fits(c) or over_share then break end
      count, budget = count + 1, budget - c
    end
    left = count < #ahead and count < free
  end
  if count > 0 then take(shared, count) end
end
-- 3. its load
if spent > 0 then redis.call('HINCRBY', loads, me, spent) end
redis.call('HSET', loads, me .. suffix_free, string.format('%d %d', math.max(free, 0), now_ms))
if left then reply[#reply + 1] = '${ScriptReply.LEFT}' end
return reply
""")
)
