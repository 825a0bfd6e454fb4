"""A worker's take, planned by one script and read by plain XREADGROUPs (`TAKE_LUA`, `WorkerStreams.take`).

The script decides how many entries of its pinned stream and of the shared one a worker takes (its fair share,
O(log W) in the fleet's size W) and counts them at once in `Keys.loads`, from counts and the queued costs list
(`Keys.queued_costs`), without reading an entry; the worker then reads that many with XREADGROUP. What a script
reads of a stream is converted to Lua values entry by entry, and what it returns back again: measured on Redis 7.0
here, an XREADGROUP of 16 entries of 667 bytes cost 107 us inside a script and 146 us returned from it, against 49
us sent plainly, and a take that looked at the queued entries first (XRANGE) paid for them a third time.
"""

from rollout_svc.dataplane.levels import with_levels

# A worker's take plan (`WorkerStreams.take`).
# KEYS: [1] its pinned stream, [2] the shared stream, [3..6] `Keys.load_keys` (the loads hash, `Keys.levels`,
# `Keys.open_at`, `Keys.queued_costs`).
# ARGV: [1] group, [2] worker id, [3] free slots, [4] the open workers' TTL ms (a worker silent longer is closed),
# [5] the most queued entries it weighs, [6] tokens it read that no script counted yet (a blocking read; or, signed,
# what its last take read beyond or short of its plan), added to its load, [7] 1 if it holds nothing (its load is
# then 0: a request that left it other than by a publish, requeued or forwarded, would otherwise count for ever),
# [8] 1 to share (placement `cost`), 0 to take whatever fits (`fifo`), [9] the part of [6] read from its pinned
# stream (taken off ID:pinned; the rest off the queued tokens), [10] its engine's KV cache and [11] its context, in
# tokens (0: not known).
# 1. Its pinned entries (its sessions): those waiting (the stream's length less its group's pending entries: an
# answered entry is deleted), up to its free slots. Their tokens (ID:pinned) move to its load; ID:pinned is set
# right (0) when none waits.
# 2. If entries wait in the shared stream, the share that brings its load to the level the open workers' loads would
# reach if the queued tokens (`keys.QUEUED_FIELD`) were spread over them in proportion to their weights (water level:
# queued tokens plus the open workers' loads, over their weights: the sums `dataplane.levels` keeps), each entry weighed
# at its cost from `Keys.queued_costs` ("id cost", in stream order: its head, up to the group's last delivered id, is
# dropped first; where it does not match the entries waiting, the entries are read instead and it is rebuilt once they
# all fit the window; the list is read as far as its share goes, O(share) not O(queue)). It stops at an entry costing
# more than its context that a wider context holds (the widest said, `WIDEST_FIELD`; one that fits nowhere is taken as
# before), and past its share takes only what no other context holds (`NARROWEST_FIELD`); at least one entry if it is
# the least loaded open worker (the first of `Keys.levels`), so nothing waits while it has room. Their tokens move from
# the queued ones to its load.
# 3. Its load, free slots and level. Every step is O(log W) in the open workers.
# Returns {pinned entries to read, shared entries to read, their tokens, the pinned ones' tokens, 1 if it left
# waiting entries to other workers' shares (the caller then waits for a slot of its own, not for new entries), 1 if
# nothing is left waiting for it (the caller's next read blocks)}. Another worker's read may come between the plan
# and the reads: the caller counts what it read beyond or short of the plan in its next script call ([6], [9]).
TAKE_LUA = with_levels(
    """
local pinned, shared = KEYS[1], KEYS[2]
local group, me, free = ARGV[1], ARGV[2], tonumber(ARGV[3])
local ttl_ms, peek = tonumber(ARGV[4]), tonumber(ARGV[5])
local kv_me, ctx_me = tonumber(ARGV[10] or '0') or 0, tonumber(ARGV[11] or '0') or 0
local at = now_ms()
local left = false
local spent, carried_pinned = tonumber(ARGV[6]), tonumber(ARGV[9])
-- every field of the loads hash it reads, in one read (its own, then [8..11] the sums and contexts); what it changes
-- is written once, at the end (step 3)
local function read_loads()
  return own_loads(L, me, '${SUM_FIELD}', '${WEIGHTS_FIELD}', '${WIDEST_FIELD}', '${NARROWEST_FIELD}')
end
local h = read_loads()
-- the silent are closed as often as its stamp is renewed (`RESTAMP_MS`), the sums read again if it closed any
local _, _, _, stamped_at = in_of(h[5])
if at - stamped_at >= RESTAMP_MS and close_silent(L, ttl_ms, at, 4) > 0 then h = read_loads() end
local held, my_pinned, queued = num(h[1]), num(h[2]), num(h[3])
if carried_pinned ~= 0 then my_pinned = math.max(0, my_pinned - carried_pinned) end
if spent ~= carried_pinned then  -- what its reads took from the shared stream beyond (or short of) a plan
  queued = math.max(0, queued - (spent - carried_pinned))
end
if ARGV[7] == '1' then held = 0 end
local function waiting_in(stream)  -- {entries waiting (not delivered), the group's last delivered id}
  local length = redis.call('XLEN', stream)
  if length == 0 then return 0, '${StreamSyntax.FIRST_ID}' end
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local info = {}
    for i = 1, 11, 2 do  -- not #g: a null field (entries-read) may end the table early under fakeredis
      if g[i] then info[g[i]] = g[i + 1] end
    end
    if info['${StreamSyntax.GROUP_NAME}'] == group then
      return length - (tonumber(info['${StreamSyntax.PENDING}']) or 0), info['${StreamSyntax.LAST_DELIVERED_ID}']
    end
  end
  return 0, '${StreamSyntax.FIRST_ID}'
end
-- 1. pinned
local pinned_count, pinned_tokens, pinned_waiting = 0, 0, 0
if free > 0 then
  pinned_waiting = waiting_in(pinned)
  pinned_count = math.min(free, pinned_waiting)
  if pinned_count == pinned_waiting then
    pinned_tokens = my_pinned
  elseif pinned_count > 0 then
    pinned_tokens = math.floor(my_pinned * pinned_count / pinned_waiting)
  end
  my_pinned = my_pinned - pinned_tokens
  free = free - pinned_count
  spent = spent + pinned_tokens
end
-- 2. shared
local function id_at_most(a, b)  -- stream ids: a <= b
  local am, as = string.match(a or '', '^(%d+)-(%d+)$$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$$')
  if not am or not bm then return false end
  am, bm = tonumber(am), tonumber(bm)
  return am < bm or (am == bm and tonumber(as) <= tonumber(bs))
end
local function id_of(item) return item and string.match(item, '^(%S+) ') end
-- an item of the costs list ("id cost"): its cost, parsed only when the share reaches it (`next_cost`): a take weighs
-- its share's entries and the one it stops at, not the whole window it read (matching a pattern on each of 32 items
-- cost Redis more than reading them, 14 against 11 us, measured on Redis 7.0 here)
local function cost_of(item)
  local at = string.find(item, '%s')
  return clamp_cost(at and string.sub(item, at + 1))
end
-- the items of up to `window` entries waiting after `last`, in stream order, from the costs list once its head up
-- to `last` is dropped; nil where it does not match the `waiting` entries (an entry gone other than by a take)
local function listed_costs(window, waiting, last)
  local gone = redis.call('LLEN', L.costs) - waiting
  if gone < 0 or (gone > 0 and not id_at_most(id_of(redis.call('LINDEX', L.costs, gone - 1)), last)) then
    return nil
  end
  if gone > 0 then redis.call('LTRIM', L.costs, gone, -1) end
  local head = redis.call('LRANGE', L.costs, 0, window - 1)
  if #head > 0 and id_at_most(id_of(head[1]), last) then return nil end
  return head
end
-- the list's next items after the `#costs` read, up to `n` of them, appended to `costs`; false if none were left
local function more_costs(costs, n)
  local items = redis.call('LRANGE', L.costs, #costs, #costs + n - 1)
  for _, item in ipairs(items) do costs[#costs + 1] = item end
  return #items > 0
end
-- the same read from the entries, the list rebuilt from them where they are all that wait
local function read_costs(window, waiting, last)
  local costs, items = {}, {}
  for i, e in ipairs(redis.call('XRANGE', shared, '${StreamSyntax.EXCLUSIVE}' .. last, '+', 'COUNT', window)) do
    local c = 1
    for j = 1, #e[2], 2 do
      if e[2][j] == '${COST_FIELD}' then c = clamp_cost(e[2][j + 1]) end
    end
    costs[i], items[i] = c, string.format('%s %d', e[1], c)
  end
  if #items == waiting then
    redis.call('DEL', L.costs)
    for i = 1, #items, 1000 do redis.call('RPUSH', L.costs, unpack(items, i, math.min(i + 999, #items))) end
  end
  return costs
end
local shared_count, shared_tokens, waiting, looked = 0, 0, 0, free > 0
if looked then
  local last
  waiting, last = waiting_in(shared)
  if waiting <= 0 then
    queued = 0  -- nothing waits: a drifted count is set right
    if waiting == 0 then redis.call('DEL', L.costs) end
  else
    local window = math.min(free, peek)
    local in_load, in_w = in_of(h[5])
    local widest, narrowest = num(h[10]), num(h[11])
    local w_me = weight_of(kv_me, num(h[6]), num(h[7]))
    local mine = held + spent + my_pinned
    local level_sum, weight_sum = num(h[8]) - in_load + mine, num(h[9]) - in_w + w_me
    local least = true
    local lowest = redis.call('ZRANGE', L.levels, 0, 1, 'WITHSCORES')
    for i = 1, #lowest, 2 do
      local id, level = lowest[i], tonumber(lowest[i + 1])
      if id ~= me then
        if level < mine / w_me or (level == mine / w_me and id < me) then least = false end
        break
      end
    end
    local function fits(c)  -- false: a wider context holds it and mine does not: left to it
      return ctx_me == 0 or c <= ctx_me or c > widest
    end
    local budget = (queued + level_sum) * w_me / weight_sum - mine
    -- a share's costs are read from the list as it goes: first about twice what its budget buys at the queue's mean
    -- cost, so a take costs Redis its share's entries, not the queue's
    local first = window
    if ARGV[8] ~= '0' then
      first = math.min(window, math.max(16, 2 * math.ceil(budget * waiting / math.max(queued, 1))))
    end
    local costs = listed_costs(first, waiting, last)
    local listed = costs ~= nil
    costs = costs or read_costs(window, waiting, last)
    local function next_cost(i)  -- the i-th waiting entry's cost (nil past the last weighed), read on when listed
      if i > #costs and listed and #costs < math.min(window, waiting) then
        more_costs(costs, math.min(2 * #costs, window - #costs))
      end
      local c = costs[i]
      if listed and c then c = cost_of(c) end  -- listed: the list's items, each read once; else costs read already
      return c
    end
    if ARGV[8] == '0' then
      for i = 1, #costs do
        local c = next_cost(i)
        if not fits(c) then left = true break end
        shared_count, shared_tokens = i, shared_tokens + c
      end
    else
      local i, c = 1, next_cost(1)
      while c do
        -- past its share what no other context holds: over the widest said (none holds it), or, for a worker of
        -- the widest context, over the narrowest (a narrower one leaves it); where none said one, nothing is so
        local only_mine = widest > 0 and (ctx_me == 0 or c <= ctx_me)
          and (c > widest or (ctx_me >= widest and c > narrowest))
        local over_share = budget < c / 2 and not (shared_count == 0 and least) and not only_mine
        if shared_count >= free or not fits(c) or over_share then break end
        shared_count, shared_tokens, budget = shared_count + 1, shared_tokens + c, budget - c
        i = i + 1
        c = next_cost(i)
      end
      left = c ~= nil  -- it stopped at a waiting entry
    end
    if shared_tokens > 0 then
      queued = math.max(0, queued - shared_tokens)
      spent = spent + shared_tokens
    end
    free = free - shared_count
  end
end
-- 3. its load, free slots and level: the fields it changed in one write, then its level from them
settle(L, me, h, math.max(0, held + spent), my_pinned, queued, free > 0, at)
local drained = looked and pinned_count == pinned_waiting and shared_count >= waiting
return {pinned_count, shared_count, pinned_tokens + shared_tokens, pinned_tokens, left and 1 or 0, drained and 1 or 0}
""",
    first_key=3,
)
