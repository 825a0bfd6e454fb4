"""The data plane's placement scripts: where a rollout request goes (the enqueue script places sessions; a take
shares the shared queue, `dataplane.take`), each O(log W) in the fleet's size W (`dataplane.levels` keeps what they
read).

Each declares the keys it names in KEYS (`Keys.fleet`: the state hash, the loads hash, the two sorted sets of open
workers); the keys of the one worker a session goes to (heartbeat, session set, pinned stream) are built from
`Keys.worker_stems` in ARGV, in the same hash slot as the declared ones.
"""

from rollout_svc.dataplane.levels import COST_LUA, LEVELS_LUA, LOADS_LUA, with_levels
from rollout_svc.keys import lua

PLACE_PAGE = 4  # the open workers of the lowest level a new session's placement compares by their sessions
# Where more than PLACE_PAGE tie at the lowest level (an idle fleet), the ones it compares: two next to each other in
# `Keys.levels` at an offset by the session id's hash, after the power of two choices (Mitzenmacher, "The Power of Two
# Choices in Randomized Load Balancing", IEEE TPDS 12(10), 2001: two random choices bring the most a bin holds from
# about log W / log log W to log log W / log 2). Neighbours are not independent choices; the bound is a guide.
PLACE_CHOICES = 2
PLACE_WALK = 32  # the most open workers it looks at for one that is serving and converged, before the shared stream

# fleet_at(kf, af): the fleet block of KEYS from index kf (`Keys.fleet`) and of ARGV from af (`Keys.worker_stems`).
# place(f, epoch, ttl_ms, skey, sid, preferred, keep_draining): a live pin stays unless its worker sleeps, drains (kept
# for a forward) or is stale; otherwise the preferred worker, if serving or paused, takes the session; otherwise the
# open worker of the lowest level: of the lowest level's first PLACE_PAGE (where more tie, PLACE_CHOICES of them from
# an offset by the session id's hash, so that an idle fleet's sessions spread), the one with the fewest unexpired
# sessions, then the lowest id (sessions counted only where two or more tie: one read of the levels and no count where
# one is lowest), if it is serving or paused and converged (applied the current epoch); if not, the first such of the
# open workers in level order (at most PLACE_WALK). None: false (the shared stream). How many tie at the lowest level
# is counted once a script (f.low: levels only rise within one, and `queued` counts those that leave it). queued(f, w,
# cost) adds a request placed in w's pinned stream to its ID:pinned and level at once; unqueue(f) takes them off again
# (a call refused for admission).
PLACE_LUA = (
    COST_LUA
    + LOADS_LUA
    + LEVELS_LUA
    + f"local PLACE_PAGE, PLACE_CHOICES, PLACE_WALK = {PLACE_PAGE}, {PLACE_CHOICES}, {PLACE_WALK}\n"
    + lua("""
local function fleet_at(kf, af)
  return {state = KEYS[kf], loads = KEYS[kf + 1], levels = KEYS[kf + 2], open_at = KEYS[kf + 3],
          costs = KEYS[kf + 4], hb = ARGV[af], zs = ARGV[af + 1], pinned = ARGV[af + 2], placed = {}, bounds = {},
          next_key = kf + 5, next_arg = af + 3}
end
local function push_costs(f, costs)  -- "id cost" of entries added to the shared stream (`Keys.queued_costs`)
  if #costs > 0 then redis.call('RPUSH', f.costs, unpack(costs)) end
  return {}
end
local function queued(f, w, cost)
  local c = clamp_cost(cost)
  f.placed[w] = (f.placed[w] or 0) + c
  redis.call('HINCRBY', f.loads, w .. '${PINNED_SUFFIX}', c)
  local level, was, tokens = relevel(f, w, nil)
  -- entries in its pinned stream: each costs at least a token, counted in ID:pinned until taken and in ID until
  -- answered (and deleted), so its tokens bound them (the admission check reads the stream only past the limit)
  f.bounds[f.pinned .. w] = level and tokens or nil
  local low = f.low
  if low and was == low.level then  -- it left the lowest level (a cost is at least 1 token)
    low.tied = low.tied - 1
    if low.tied <= 0 then f.low = nil end
  end
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
-- the workers of the lowest level that `place` compares: its first PLACE_PAGE, or, where more tie, PLACE_CHOICES of
-- them from an offset by the session id's hash, read directly by the script's next placements (f.low)
local function tied_page(f, low, sid)
  local offset = hash_of(sid) % (low.tied - PLACE_CHOICES + 1)
  return redis.call('ZRANGE', f.levels, low.score, low.score, 'BYSCORE', 'LIMIT', offset, PLACE_CHOICES, 'WITHSCORES')
end
local function lowest_page(f, sid)
  local low = f.low
  if low and low.tied > PLACE_PAGE then
    local page = tied_page(f, low, sid)
    if #page > 0 then return page end
    f.low = nil  -- fewer tie than counted (a count that drifted): read afresh
  end
  local page = redis.call('ZRANGE', f.levels, 0, PLACE_PAGE - 1, 'WITHSCORES')
  if #page == 2 * PLACE_PAGE and page[#page] == page[2] then  -- the whole page ties: more may, past it
    low = f.low
    if not (low and low.score == page[2]) then
      low = {score = page[2], level = tonumber(page[2]), tied = redis.call('ZCOUNT', f.levels, page[2], page[2])}
      f.low = low
    end
    if low.tied > PLACE_PAGE then
      local at_offset = tied_page(f, low, sid)
      if #at_offset > 0 then page = at_offset end
    end
  end
  return page
end
local function place(f, epoch, ttl_ms, skey, sid, preferred, keep_draining)
  f.now = f.now or now_ms()  -- one clock read a script
  local at = f.now
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
  local page = lowest_page(f, sid)
  if #page == 0 then return false end
  local best, best_level, best_sessions = page[1], tonumber(page[2]), nil
  for i = 3, #page, 2 do  -- of those tied at the lowest level, the one with the fewest unexpired sessions
    local id = page[i]
    if tonumber(page[i + 1]) > best_level then break end
    best_sessions = best_sessions or redis.call('ZCOUNT', f.zs .. best, at, '+inf')
    local sessions = redis.call('ZCOUNT', f.zs .. id, at, '+inf')
    if sessions < best_sessions or (sessions == best_sessions and id < best) then
      best, best_sessions = id, sessions
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
# added to the queued tokens (`keys.QUEUED_FIELD`), and its id and cost to the queued costs (`Keys.queued_costs`).
# Placement happens before the admission check, so a refused chunk may still have pinned its sessions: harmless,
# the pins expire (what it placed is taken off the workers' loads again). The check reads a worker's pinned stream's
# length (XLEN) only where the tokens it holds, a bound of its entries (`queued`), pass the limit.
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
    if not (f.bounds[target] and f.bounds[target] <= limit) then  -- a bound of its length within the limit: admitted
      local len = redis.call('XLEN', target)
      if len + c > limit then
        unqueue(f)
        return {'${ScriptReply.FULL}', target, len}
      end
    end
  end
end
local reply, to_shared, costs = {'${ScriptReply.OK}'}, 0, {}
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
  if key == KEYS[shared] then
    local c = clamp_cost(ARGV[at + 2])
    to_shared = to_shared + c
    costs[#costs + 1] = string.format('%s %d', id, c)
    if #costs == 1000 then costs = push_costs(f, costs) end
  end
  reply[i + 1] = id
end
push_costs(f, costs)
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
