"""The control plane's Lua scripts (run by `control.plane`), rendered once at import.

Each declares every key it touches in KEYS, binds its fixed KEYS and ARGV to named locals first, and names every
field and nudge through `keys.lua` placeholders (`'${StateField.EPOCH}'`), never spelled here.
"""

from rollout_svc.keys import lua

# Redis' clock in unix ms, for the scripts that compare or write times (leases, tombstones).
_CLOCK = lua("""
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
""")

# Shared by the scripts that write pause holders: the clock, and the pruning of every pause whose lease lapsed (its
# holder field and lease go; a `lapsed:{holder}` field keeps when, for `status`).
_LEASES = _CLOCK + lua("""
local function prune_lapsed(state, now)
  local lease_prefix = '${StateField.LEASE_PREFIX}'
  local fields = redis.call('HGETALL', state)
  for i = 1, #fields, 2 do
    local f = fields[i]
    if string.sub(f, 1, #lease_prefix) == lease_prefix and tonumber(fields[i + 1]) <= now then
      local holder = string.sub(f, #lease_prefix + 1)
      redis.call('HDEL', state, f, '${StateField.HOLDER_PREFIX}' .. holder)
      redis.call('HSET', state, '${StateField.LAPSED_PREFIX}' .. holder, fields[i + 1])
    end
  end
end
""")

# KEYS: [1] state hash, [2] command log. ARGV: [1] the command (msgpack), [2] log length, [3] control channel,
# [4] a lease field to set to now + [5] ms ('' and 0: none), [6] how many fields to set, then field/value pairs,
# then fields to delete. Pauses whose lease lapsed are pruned first. Returns the new epoch.
ISSUE_LUA = _LEASES + lua("""
local state, commands = KEYS[1], KEYS[2]
local command, log_len, channel = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local lease_field, lease_ms, n = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
local now = now_ms()
prune_lapsed(state, now)
local epoch = redis.call('HINCRBY', state, '${StateField.EPOCH}', 1)
for i = 0, n - 1 do redis.call('HSET', state, ARGV[7 + 2 * i], ARGV[8 + 2 * i]) end
if lease_field ~= '' then redis.call('HSET', state, lease_field, now + lease_ms) end
for i = 7 + 2 * n, #ARGV do redis.call('HDEL', state, ARGV[i]) end
redis.call('ZADD', commands, epoch, command)
redis.call('ZREMRANGEBYRANK', commands, 0, -log_len - 1)
redis.call('PUBLISH', channel, '${Nudge.COMMAND}')
return epoch
""")

# KEYS: [1] state hash. ARGV: [1] a holder's pause field, [2] its lease field, [3] the lease in ms. Extends the
# lease to now + ms. Returns 1 if the holder still holds its pause (leased, or held without a lease), 0 if not (it
# was resumed, or its lease lapsed: then it is pruned, and the holder must not act as if paused).
RENEW_LEASE_LUA = _LEASES + lua("""
local state = KEYS[1]
local holder_field, lease_field, lease_ms = ARGV[1], ARGV[2], tonumber(ARGV[3])
local now = now_ms()
prune_lapsed(state, now)
if redis.call('HEXISTS', state, holder_field) == 0 then return 0 end
if redis.call('HEXISTS', state, lease_field) == 1 then redis.call('HSET', state, lease_field, now + lease_ms) end
return 1
""")

# KEYS: [1] state hash. ARGV: [1] weight version, [2] checkpoint, [3] weights channel, [4] control channel, [5] the
# version's digest ("" for a checkpoint). Commits
# the version only into a state hash that exists: a Redis that restarted empty gets its state back from the workers
# (the reseed) first, else the commit would create a state of one field (no epoch, no pauses, the version reset).
# Returns 1 if committed, 0 if the state is missing.
COMMIT_LUA = lua("""
local state = KEYS[1]
local version, checkpoint, weights_channel, control_channel, digest = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
if redis.call('EXISTS', state) == 0 then return 0 end
redis.call('HSET', state, '${StateField.WEIGHT_VERSION}', version, '${StateField.WEIGHT_CHECKPOINT}', checkpoint,
  '${StateField.WEIGHT_DIGEST}', digest)
redis.call('PUBLISH', weights_channel, '${Nudge.WEIGHT_COMMIT}')
redis.call('PUBLISH', control_channel, '${Nudge.COMMAND}')
return 1
""")

# KEYS: [1] state hash. ARGV: field/value pairs. A worker that finds the state missing (a Redis that forgot)
# writes back what it last applied, unless another worker already has: a paused fleet does not silently resume.
# HSETNX, not HSET (the same here, the hash being missing): a worker's Redis user may add state fields, not change them.
RESEED_LUA = lua("""
local state = KEYS[1]
if redis.call('EXISTS', state) == 1 then return 0 end
for i = 1, #ARGV, 2 do redis.call('HSETNX', state, ARGV[i], ARGV[i + 1]) end
return 1
""")

# KEYS: [1] tombstones. ARGV: [1] ttl ms, [2] cancel channel, then request ids. Expired tombstones are pruned.
CANCEL_LUA = _CLOCK + lua("""
local tombstones = KEYS[1]
local ttl_ms, channel = tonumber(ARGV[1]), ARGV[2]
local now = now_ms()
redis.call('ZREMRANGEBYSCORE', tombstones, '-inf', now)
for i = 3, #ARGV do redis.call('ZADD', tombstones, now + ttl_ms, ARGV[i]) end
redis.call('PUBLISH', channel, '${Nudge.CANCEL}')
return #ARGV - 2
""")
