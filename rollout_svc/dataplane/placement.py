"""The data plane's placement scripts: where a rollout request goes (the enqueue script places sessions, a take
shares the shared queue), each O(log W) in the fleet's size W (`dataplane.levels` keeps what they read).

Each declares the keys it names in KEYS (`Keys.fleet`: the state hash, the loads hash, the two sorted sets of open
workers); the keys of the one worker a session goes to (heartbeat, session set, pinned stream) are built from
`Keys.worker_stems` in ARGV, in the same hash slot as the declared ones.
"""

from rollout_svc.dataplane.levels import COST_LUA, LEVELS_LUA, LOADS_LUA, with_levels
from rollout_svc.keys import lua

PLACE_PAGE = 4  # the open workers of the lowest level a new session's placement compares by their sessions
PLACE_WALK = 32  # the most open workers it looks at for one that is serving and converged, before the shared stream

# fleet_at(kf, af): the fleet block of KEYS from index kf (`Keys.fleet`) and of ARGV from af (`Keys.worker_stems`).
# place(f, epoch, ttl_ms, skey, sid, preferred, keep_draining): a live pin stays unless its worker sleeps, drains (kept
# for a forward) or is stale; otherwise the preferred worker, if serving or paused, takes the session; otherwise the
# open worker of the lowest level: of the lowest level's first PLACE_PAGE (from an offset by the session id's hash
# where more share it, so that an idle fleet's sessions spread), the one with the fewest unexpired sessions, then the
# lowest id, if it is serving or paused and converged (applied the current epoch); if not, the first such of the
# open workers in level order (at most PLACE_WALK). None: false (the shared stream). queued(f, w, cost)
# adds a request placed in w's pinned stream to its ID:pinned and level at once; unqueue(f) takes them off again (a
# call refused for admission).
PLACE_LUA = (
    COST_LUA
    + LOADS_LUA
    + LEVELS_LUA
    + f"local PLACE_PAGE, PLACE_WALK = {PLACE_PAGE}, {PLACE_WALK}\n"
    + lua("""
local function fleet_at(kf, af)
  return {state = KEYS[kf], loads = KEYS[kf + 1], levels = KEYS[kf + 2], open_at = KEYS[kf + 3],
          hb = ARGV[af], zs = ARGV[af + 1], pinned = ARGV[af + 2], placed = {}, next_key = kf + 4, next_arg = af + 3}
end
local function queued(f, w, cost)
  local c = clamp_cost(cost)
  f.placed[w] = (f.placed[w] or 0) + c
  redis.call('HINCRBY', f.loads, w .. '${PINNED_SUFFIX}', c)
  relevel(f, w, nil)
end
local function unqueue(f)
  for w, c in pairs(f.placed) do
    add_to_load(f.loads, w .. '${PINNED_SUFFIX}', -c)
    relevel(f, w, nil)
  end
end
local function epoch_of(f) return tonumber(redis.call('HGET', f.state, '${StateField.EPOCH}') or '0') end
local function hash_of(text)
  local h = 0
  for i = 1, #text do h = (h * 31 + string.byte(text, i)) % 1000003 end
  return h
end
local function place(f, epoch, ttl_ms, skey, sid, preferred, keep_draining)
  local at = now_ms()
  local function pin(w, new)  -- `new`: a session new to w, whose set is then cleared of expired ones
    redis.call('SET', skey, w, 'PX', ttl_ms)
    if new then redis.call('ZREMRANGEBYSCORE', f.zs .. w, '-inf', at) end
    redis.call('ZADD', f.zs .. w, at + ttl_ms, sid)
    return w
  end
  local function placeable(id)
    local h = redis.call('HMGET', f.hb .. id, '${HeartbeatField.STATE}', '${HeartbeatField.APPLIED_EPOCH}')
    return (h[1] == '${WorkerLabel.SERVING}' or h[1] == '${WorkerLabel.PAUSED}') and tonumber(h[2] or '0') >= epoch
  end
  local w = redis.call('GET', skey)
  if w then
    local state = redis.call('HGET', f.hb .. w, '${HeartbeatField.STATE}')
    if state and state ~= '${WorkerLabel.SLEEPING}' and state ~= '${WorkerLabel.STALE}'
        and (state ~= '${WorkerLabel.DRAINING}' or keep_draining) then
      return pin(w)
    end
    redis.call('ZREM', f.zs .. w, sid)
    redis.call('DEL', skey)
  end
  if preferred then
    local state = redis.call('HGET', f.hb .. preferred, '${HeartbeatField.STATE}')
    if state == '${WorkerLabel.SERVING}' or state == '${WorkerLabel.PAUSED}' then return pin(preferred, true) end
  end
  local first = redis.call('ZRANGE', f.levels, 0, 0, 'WITHSCORES')
  if #first == 0 then return false end
  local tied, offset = redis.call('ZCOUNT', f.levels, first[2], first[2]), 0
  if tied > PLACE_PAGE then offset = hash_of(sid) % (tied - PLACE_PAGE + 1) end
  local page = redis.call('ZRANGE', f.levels, offset, offset + PLACE_PAGE - 1, 'WITHSCORES')
  local best, best_level, best_sessions = false, 0, 0
  for i = 1, #page, 2 do
    local id, level = page[i], tonumber(page[i + 1])
    if best and level > best_level then break end
    local sessions = redis.call('ZCOUNT', f.zs .. id, at, '+inf')  -- unexpired
    if not best or level < best_level or sessions < best_sessions or (sessions == best_sessions and id < best) then
      best, best_level, best_sessions = id, level, sessions
    end
  end
  if best and placeable(best) then return pin(best, true) end
  for _, id in ipairs(redis.call('ZRANGE', f.levels, 0, PLACE_WALK - 1)) do
    if placeable(id) then return pin(id, true) end
  end
  return false
end
""")
)

# KEYS: [1] shared requests stream, [2] token requests stream, the fleet from [3] (`Keys.fleet`), then one session
# key per session item, then the streams of the entries to ack. ARGV: [1] session ttl ms, [2] limit (-1: none),
# [3] group, [4..6] `Keys.worker_stems`, [7] the item count and 4 per item (kind, session id or '', cost in tokens or
# 0, payload), then the ack count and 2 per ack (key index, entry id). The kind is an `EnqueueKind` ('g' rollout
# request, 't' tokenize), and for a requeue 'g DELIVERIES EPOCH' (a new request gets the current epoch, as does an
# empty EPOCH, and no delivery count); 'f' (a forward, `EnqueueKind.FORWARD`, as 'g' otherwise) keeps its session's
# pin to a worker that drains. Returns (`ScriptReply`) {'full', stream, length} or {'ok', entry id per item, then the
# worker each session item went to ('' for the shared stream)}. The tokens of what goes to the shared stream are
# added to the queued tokens (`keys.QUEUED_FIELD`).
# Placement happens before the admission check, so a refused chunk may still have pinned its sessions: harmless,
# the pins expire (what it placed is taken off the workers' loads again).
ENQUEUE_LUA = PLACE_LUA + lua("""
local shared, tokens = 1, 2  -- the KEYS indices of the shared and the token requests streams
local ttl_ms, limit, group = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local f = fleet_at(3, 4)
local epoch = tostring(epoch_of(f))
local k, a = f.next_key, f.next_arg
local n = tonumber(ARGV[a])
local first = a + 1
local targets, workers, counts = {}, {}, {}
for i = 1, n do
  local at = first + 4 * (i - 1)
  local target = KEYS[shared]
  if ARGV[at] == '${EnqueueKind.TOKENS}' then
    target = KEYS[tokens]
  elseif ARGV[at + 1] ~= '' then
    local w = place(f, tonumber(epoch), ttl_ms, KEYS[k], ARGV[at + 1], false,
      string.sub(ARGV[at], 1, 1) == '${EnqueueKind.FORWARD}')
    k = k + 1
    if w then
      target = f.pinned .. w
      queued(f, w, ARGV[at + 2])
    end
    workers[#workers + 1] = w or ''
  end
  targets[i] = target
  counts[target] = (counts[target] or 0) + 1
end
if limit >= 0 then
  for target, c in pairs(counts) do
    local len = redis.call('XLEN', target)
    if len + c > limit then
      unqueue(f)
      return {'${ScriptReply.FULL}', target, len}
    end
  end
end
local reply, to_shared = {'${ScriptReply.OK}'}, 0
for i = 1, n do
  local at = first + 4 * (i - 1)
  local kind, sid, key = ARGV[at], ARGV[at + 1], targets[i]
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
  if key == KEYS[shared] then to_shared = to_shared + clamp_cost(ARGV[at + 2]) end
  reply[i + 1] = id
end
if to_shared > 0 then redis.call('HINCRBY', f.loads, '${QUEUED_FIELD}', to_shared) end
for _, w in ipairs(workers) do reply[#reply + 1] = w end
a = first + 4 * n
for _ = 1, tonumber(ARGV[a]) do
  local key, id = KEYS[tonumber(ARGV[a + 1])], ARGV[a + 2]
  redis.call('XACK', key, group, id)
  redis.call('XDEL', key, id)
  a = a + 2
end
return reply
""")

# KEYS: the fleet (`Keys.fleet`), then the session key. ARGV: session ttl ms, `Keys.worker_stems`, session id, worker
# id. A worker that took a session's request from the shared stream pins the session to itself unless a live worker
# holds it (one that drains too: it may be running a request of the session; the caller forwards the request to it,
# `EnqueueKind.FORWARD`). Returns {'ok', the pinned worker or ''}.
PIN_LUA = PLACE_LUA + lua("""
local ttl_ms = tonumber(ARGV[1])
local f = fleet_at(1, 2)
local skey, sid, worker_id = KEYS[f.next_key], ARGV[f.next_arg], ARGV[f.next_arg + 1]
local w = place(f, epoch_of(f), ttl_ms, skey, sid, worker_id, true)
return {'${ScriptReply.OK}', w or ''}
""")

# KEYS: the fleet, then the session key. ARGV: `Keys.worker_stems`, session id. Unpins a session so its next turn is
# placed anew. Returns {'ok', 1 if it was pinned}.
FINISH_SESSION_LUA = PLACE_LUA + lua("""
local f = fleet_at(1, 1)
local skey, sid = KEYS[f.next_key], ARGV[f.next_arg]
local w = redis.call('GET', skey)
if w then redis.call('ZREM', f.zs .. w, sid) end
return {'${ScriptReply.OK}', redis.call('DEL', skey)}
""")

# KEYS: [1] the worker's pinned stream, [2] the loads hash, [3] `Keys.levels`, [4] `Keys.open_at`. ARGV: [1] the
# worker id, [2] the cost in tokens, then the entry's field/value pairs. Adds a straggler moved there (`moves`) past
# admission, counted as placement counts it (ID:pinned, its level). Returns the entry id.
HAND_OVER_LUA = with_levels(
    """
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 3))
redis.call('HINCRBY', L.loads, ARGV[1] .. '${PINNED_SUFFIX}', clamp_cost(ARGV[2]))
relevel(L, ARGV[1], nil)
return id
""",
    first_key=2,
)

# A worker's take of rollout requests, non-blocking, by fair share of the work (`WorkerStreams.take`).
# KEYS: [1] its pinned stream, [2] the shared stream, [3] the loads hash, [4] `Keys.levels`, [5] `Keys.open_at`.
# ARGV: [1] group, [2] worker id, [3] free slots, [4] the open workers' TTL ms (a worker silent longer is closed),
# [5] the most queued entries it peeks at, [6] tokens it took outside (its blocking read of the next entry), added
# to its load, [7] 1 if it holds nothing (its load is then 0: a request that left it other than by a publish,
# requeued or forwarded, would otherwise count for ever), [8] 1 to share (placement `cost`), 0 to take whatever fits
# (`fifo`), [9] the part of [6] read from its pinned stream (taken off ID:pinned first; the rest off the queued
# tokens), [10] its engine's KV cache and [11] its context, in tokens (0: not known).
# 1. Its pinned entries (its sessions), up to its free slots (ID:pinned less their cost, or 0 once none is left).
# 2. If tokens are queued in the shared stream (`keys.QUEUED_FIELD`; the queue ahead of the group read only then),
# the share that brings its load to the level the open workers' loads would reach if the queued work were spread
# over them in proportion to their weights (water level: queued tokens plus the open workers' loads, over their
# weights: the sums `dataplane.levels` keeps). It stops at an entry costing more than its context that a wider
# context holds (the widest said, `WIDEST_FIELD`; a long-context request goes where it fits; one that fits nowhere
# is taken as before), and past its share takes only what no other context holds (`NARROWEST_FIELD`). At least one
# entry if it is the least loaded open worker (the first of `Keys.levels`), so nothing waits while it has room.
# 3. Its load, free slots and level. Every step is O(log W) in the open workers.
# Returns the entries as XREADGROUP does: {stream, {{id, fields}, ...}} per stream with entries, then 'left' if it
# left queued entries to other workers' shares (the caller then waits for a slot of its own, not for new entries).
TAKE_LUA = with_levels(
    """
local pinned, shared = KEYS[1], KEYS[2]
local group, me, free = ARGV[1], ARGV[2], tonumber(ARGV[3])
local ttl_ms, peek = tonumber(ARGV[4]), tonumber(ARGV[5])
local kv_me, ctx_me = tonumber(ARGV[10] or '0') or 0, tonumber(ARGV[11] or '0') or 0
local at = now_ms()
local reply, left, spent = {}, false, tonumber(ARGV[6])
local carried_pinned = tonumber(ARGV[9])
local h = redis.call('HMGET', L.loads, me, me .. '${PINNED_SUFFIX}', '${QUEUED_FIELD}')
local held, my_pinned, queued = num(h[1]), num(h[2]), num(h[3])
if carried_pinned > 0 then my_pinned = math.max(0, my_pinned - carried_pinned) end
if spent > carried_pinned and queued > 0 then  -- what its blocking reads took from the shared stream
  queued = math.max(0, queued - (spent - carried_pinned))
  redis.call('HSET', L.loads, '${QUEUED_FIELD}', queued)
end
if ARGV[7] == '1' and held > 0 then
  held = 0
  redis.call('HSET', L.loads, me, 0)
end
local function cost_of(fields)
  for i = 1, #fields, 2 do
    if fields[i] == '${COST_FIELD}' then return clamp_cost(fields[i + 1]) end
  end
  return 1
end
local function take(stream, count)
  local r = redis.call('XREADGROUP', 'GROUP', group, me, 'COUNT', count, 'STREAMS', stream, '${StreamSyntax.NEW}')
  if not r or not r[1] then return 0 end
  local read = r[1][2] and r[1] or r  -- {{stream, entries}}; fakeredis (the `up` fallback): flat
  local cost = 0
  for _, e in ipairs(read[2]) do cost = cost + cost_of(e[2]) end
  spent = spent + cost
  reply[#reply + 1] = {read[1], read[2]}
  free = free - #read[2]
  return cost
end
-- 1. pinned, and what it leaves there (ID:pinned, which placement adds to): 0 once nothing new is left in it, so a
-- count that missed an entry (one taken by the blocking read, or moved out by a reaper) is set right
if free > 0 then
  local cost = take(pinned, free)
  my_pinned = free > 0 and 0 or math.max(0, my_pinned - cost)
end
if my_pinned ~= num(h[2]) then redis.call('HSET', L.loads, me .. '${PINNED_SUFFIX}', my_pinned) end
-- 2. shared, only while tokens are queued there (nothing: done, the common case of a fleet that keeps up)
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
if free > 0 and queued > 0 then
  local after = redis.call('EXISTS', shared) == 1 and ahead_of_group()
  local ahead = after and redis.call('XRANGE', shared, after, '+', 'COUNT', math.min(free, peek)) or {}
  if #ahead == 0 then
    redis.call('HSET', L.loads, '${QUEUED_FIELD}', 0)  -- nothing is queued: a count that drifted is set right
  else
    close_silent(L, ttl_ms, at, 4)
    local s = redis.call('HMGET', L.loads, '${SUM_FIELD}', '${WEIGHTS_FIELD}', me .. '${IN_SUFFIX}',
      '${KV_SUM_FIELD}', '${KV_COUNT_FIELD}')
    local in_load, in_w = 0, 0
    if s[3] then
      local a, b = string.match(s[3], '^(%S+) (%S+) ')
      in_load, in_w = num(a), num(b)
    end
    local w_me = weight_of(kv_me, num(s[4]), num(s[5]))
    local mine = held + spent + my_pinned
    local level_sum, weight_sum = num(s[1]) - in_load + mine, num(s[2]) - in_w + w_me
    local least = true
    local lowest = redis.call('ZRANGE', L.levels, 0, 1, 'WITHSCORES')
    for i = 1, #lowest, 2 do
      local id, level = lowest[i], tonumber(lowest[i + 1])
      if id ~= me then
        if level < mine / w_me or (level == mine / w_me and id < me) then least = false end
        break
      end
    end
    local contexts = redis.call('HMGET', L.loads, '${WIDEST_FIELD}', '${NARROWEST_FIELD}')
    local widest, narrowest = num(contexts[1]), num(contexts[2])
    local function fits(c)  -- false: a wider context holds it and mine does not: left to it
      return ctx_me == 0 or c <= ctx_me or c > widest
    end
    local count = 0
    if ARGV[8] == '0' then
      for i, e in ipairs(ahead) do
        if not fits(cost_of(e[2])) then left = true break end
        count = i
      end
    else
      local budget = (queued + level_sum) * w_me / weight_sum - mine
      for _, e in ipairs(ahead) do
        local c = cost_of(e[2])
        -- past its share what no other context holds: over the widest said (none holds it), or, for a worker of
        -- the widest context, over the narrowest (a narrower one leaves it)
        local only_mine = (ctx_me == 0 or c <= ctx_me) and (c > widest or (ctx_me >= widest and c > narrowest))
        local over_share = budget < c / 2 and not (count == 0 and least) and not only_mine
        if count >= free or not fits(c) or over_share then break end
        count, budget = count + 1, budget - c
      end
      left = count < #ahead
    end
    if count > 0 then redis.call('HSET', L.loads, '${QUEUED_FIELD}', math.max(0, queued - take(shared, count))) end
  end
end
-- 3. its load, free slots and level
if spent > 0 then redis.call('HINCRBY', L.loads, me, spent) end
relevel(L, me, free > 0, at)
if left then reply[#reply + 1] = '${ScriptReply.LEFT}' end
return reply
""",
    first_key=3,
)
