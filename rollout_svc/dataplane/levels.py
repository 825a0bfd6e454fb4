"""The Lua the data plane's scripts share to count work: a request's cost, a worker's load, and the open workers'
levels and sums, kept as loads change so that no script walks the fleet.

A worker's load is the tokens it holds (taken, not answered: `Keys.loads` field ID) plus those placed in its pinned
stream and not taken yet (ID:pinned). Its weight is its engine's KV cache in tokens (ID:holds), or, for a worker
that has not said it, the mean of those that did (1 where none did): work goes to workers in proportion to what
they hold. Its level is load / weight.

A worker is open while it says it has a free slot (every take, publish and load report calls `relevel`, stamped
with Redis's clock). The open workers are the members of `Keys.levels` (scored by level: the least loaded first,
O(log W)) and of `Keys.open_at` (scored by when they said so: a take closes the ones silent past the heartbeat TTL,
oldest first). Their sums (`keys.SUM_FIELD`, `WEIGHTS_FIELD`, `KV_SUM_FIELD`, `KV_COUNT_FIELD`) change with each
member's contribution, recorded in ID:in ("load weight kv said-at-ms"), so they stay exact whoever changed the load
between two `relevel`s of it (a hand-over adds to ID:pinned alone). The tokens queued in the shared stream and not
delivered yet are `keys.QUEUED_FIELD`: added by the enqueue script, taken off by whatever delivers or deletes an
entry, set to 0 by a take that finds nothing queued (a count that drifted, say over a Redis restart, is set right).

Each function is O(log W) in the open workers W: a constant count of commands.
"""

from rollout_svc.keys import lua

# A request's cost in tokens as every script counts it, from its cost field or argument: at most `MAX_COST`, and 1
# for anything that is not a number of at least 1 (absent, '0', garbage).
COST_LUA = lua("""
local function clamp_cost(value)
  local c = tonumber(value)  -- nil for garbage; nan fails every comparison
  if not c or not (c >= 1) then return 1 end
  return math.min(math.floor(c), ${MAX_COST})
end
""")

# add_to_load: add `tokens` (negative: take off) to a field of the loads hash (`Keys.loads`: a worker's load, its
# ID:pinned, or the queued tokens), never leaving it below 0. now_ms: Redis's clock, which every stamp is taken by (a
# worker host's clock may be off).
LOADS_LUA = lua("""
local function add_to_load(loads, field, tokens)
  if tokens == 0 then return end
  if redis.call('HINCRBY', loads, field, tokens) < 0 then redis.call('HSET', loads, field, 0) end
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
""")

# weight_of(kv, kv_sum, kv_count): a worker's weight. in_of(v): the four numbers of a worker's ID:in (load, weight, KV
# cache, said-at ms; 0 each where it is absent: not open). own_loads(L, id, ...): one HMGET of its fields as `settle`
# takes them ({load, ID:pinned, the queued tokens, ID:holds, ID:in, KV sum, KV count}), then the further fields named.
# settle(L, id, h, load, pinned, queued, open, at_ms): for a script that read `h` (own_loads) and computed the
# worker's load, ID:pinned and the queued tokens from it: those that changed written in one HSET, then `relevel` from
# them, without reading them again.
# relevel(L, id, open, at_ms, known): worker `id`'s level and its part of the sums, from its load fields as they are
# now (`known`: the caller read them already, {load, pinned tokens, holds, ID:in, KV sum, KV count}, as the hash holds
# them). L: {loads = the loads hash, levels = `Keys.levels`, open_at = `Keys.open_at`}. `open`: true (it said it has a
# free slot, at `at_ms`: it joins or stays), false (it leaves), nil (it stays as it is, member or not: a change of
# load others made). `at_ms` 0: no fresh word (a publish: its takes and load reports renew the stamp), read from
# Redis's clock only if it joins. Returns its level (load / weight), nil if it is not open; the level it had before
# (nil if it was not open); and its load in tokens (0 if it is not open).
# close_silent(L, ttl_ms, at_ms, limit): closes up to `limit` open workers silent since before at_ms - ttl_ms (a
# dead worker, until its reaper forgets it). Returns how many it closed.
RESTAMP_MS = 250
LEVELS_LUA = lua(f"local RESTAMP_MS = {RESTAMP_MS}\n") + lua("""
local function num(v)
  local n = tonumber(v or '0')
  if not n or not (n > 0) then return 0 end
  return n
end
-- a worker's weight: its KV cache in tokens, or for one that has not said it the mean of those that did (1 where none
-- did), from the KV sum and count of the others
local function weight_of(kv, kv_sum, kv_count)
  if kv > 0 then return kv end
  return kv_count > 0 and math.max(1, math.floor(kv_sum / kv_count)) or 1
end
local function in_of(v)
  if not v then return 0, 0, 0, 0 end
  local a, b, c, d = string.match(v, '^(%S+) (%S+) (%S+) ?(%S*)$$')
  return num(a), num(b), num(c), num(d)
end
local function relevel(L, id, open, at_ms, known)
  local h = known or redis.call('HMGET', L.loads, id, id .. '${PINNED_SUFFIX}', id .. '${HOLDS_SUFFIX}',
    id .. '${IN_SUFFIX}', '${KV_SUM_FIELD}', '${KV_COUNT_FIELD}')
  local was = h[4]
  if open == nil then open = was and true or false end
  local old_load, old_w, old_kv, old_at = 0, 0, 0, 0
  if was then old_load, old_w, old_kv, old_at = in_of(was) end
  local old_level = was and old_w > 0 and old_load / old_w or nil
  local load, kv, weight = 0, 0, 0  -- its part of the sums: none unless open
  if open then
    load = num(h[1]) + num(h[2])
    kv = num(string.match(h[3] or '', '^(%d+) '))
    weight = weight_of(kv, num(h[5]) - old_kv, num(h[6]) - (old_kv > 0 and 1 or 0))
  end
  if load ~= old_load then redis.call('HINCRBY', L.loads, '${SUM_FIELD}', load - old_load) end
  if weight ~= old_w then redis.call('HINCRBY', L.loads, '${WEIGHTS_FIELD}', weight - old_w) end
  if kv ~= old_kv then
    redis.call('HINCRBY', L.loads, '${KV_SUM_FIELD}', kv - old_kv)
    local joined = (kv > 0 and 1 or 0) - (old_kv > 0 and 1 or 0)
    if joined ~= 0 then redis.call('HINCRBY', L.loads, '${KV_COUNT_FIELD}', joined) end
  end
  if not open then
    if was then
      redis.call('HDEL', L.loads, id .. '${IN_SUFFIX}')
      redis.call('ZREM', L.levels, id)
      redis.call('ZREM', L.open_at, id)
    end
    return nil, old_level
  end
  -- the stamp of `Keys.open_at` is renewed once per RESTAMP_MS at most: closing the silent needs no finer clock
  if at_ms == 0 then at_ms = not was and now_ms() or nil end
  local stamp = at_ms and (not was or at_ms - old_at >= RESTAMP_MS)
  if stamp then old_at = at_ms end
  if not was or load ~= old_load or weight ~= old_w or kv ~= old_kv or stamp then
    redis.call('HSET', L.loads, id .. '${IN_SUFFIX}', string.format('%d %d %d %d', load, weight, kv, old_at))
  end
  if not was or load ~= old_load or weight ~= old_w then redis.call('ZADD', L.levels, load / weight, id) end
  if stamp then redis.call('ZADD', L.open_at, at_ms, id) end
  return load / weight, old_level, load
end
local function own_loads(L, id, ...)
  return redis.call('HMGET', L.loads, id, id .. '${PINNED_SUFFIX}', '${QUEUED_FIELD}', id .. '${HOLDS_SUFFIX}',
    id .. '${IN_SUFFIX}', '${KV_SUM_FIELD}', '${KV_COUNT_FIELD}', ...)
end
local function settle(L, id, h, load, pinned, queued, open, at_ms)
  local changed = {}
  for _, c in ipairs({{id, load, h[1]}, {id .. '${PINNED_SUFFIX}', pinned, h[2]}, {'${QUEUED_FIELD}', queued, h[3]}}) do
    if c[2] ~= tonumber(c[3] or '0') then changed[#changed + 1], changed[#changed + 2] = c[1], c[2] end
  end
  if #changed > 0 then redis.call('HSET', L.loads, unpack(changed)) end
  return relevel(L, id, open, at_ms, {load, pinned, h[4], h[5], h[6], h[7]})
end
local function close_silent(L, ttl_ms, at_ms, limit)
  local silent = redis.call('ZRANGEBYSCORE', L.open_at, '-inf', at_ms - ttl_ms - 1, 'LIMIT', 0, limit)
  for _, id in ipairs(silent) do relevel(L, id, false) end
  return #silent
end
""")


def with_levels(template: str, first_key: int = 1) -> str:
    """A script that counts work (`COST_LUA`, `LOADS_LUA`, `LEVELS_LUA`), its KEYS from `first_key` on
    `Keys.load_keys` (the loads hash, `Keys.levels`, `Keys.open_at`, `Keys.queued_costs`), bound to the table `L`
    that `relevel` takes (`L.costs`: the queued costs); `template` rendered by `lua`."""
    k = first_key
    bind = f"local L = {{loads = KEYS[{k}], levels = KEYS[{k + 1}], open_at = KEYS[{k + 2}], costs = KEYS[{k + 3}]}}\n"
    return COST_LUA + LOADS_LUA + LEVELS_LUA + bind + lua(template)
