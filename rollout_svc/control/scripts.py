"""The control plane's Lua scripts (run by `control.plane`), rendered once at import.

Each declares every key it touches in KEYS, binds its fixed KEYS and ARGV to named locals first, and names every
field and nudge through `keys.lua` placeholders (`'${StateField.EPOCH}'`), never spelled here.
"""

from rollout_svc.keys import lua

# KEYS: [1] state hash, [2] command log. ARGV: [1] the command (msgpack), [2] log length, [3] control channel,
# [4] how many fields to set, then field/value pairs, then fields to delete. Returns the new epoch.
ISSUE_LUA = lua("""
local state, commands = KEYS[1], KEYS[2]
local command, log_len, channel, n = ARGV[1], tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local epoch = redis.call('HINCRBY', state, '${StateField.EPOCH}', 1)
for i = 0, n - 1 do redis.call('HSET', state, ARGV[5 + 2 * i], ARGV[6 + 2 * i]) end
for i = 5 + 2 * n, #ARGV do redis.call('HDEL', state, ARGV[i]) end
redis.call('ZADD', commands, epoch, command)
redis.call('ZREMRANGEBYRANK', commands, 0, -log_len - 1)
redis.call('PUBLISH', channel, '${Nudge.COMMAND}')
return epoch
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
CANCEL_LUA = lua("""
local tombstones = KEYS[1]
local ttl_ms, channel = tonumber(ARGV[1]), ARGV[2]
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', tombstones, '-inf', now_ms)
for i = 3, #ARGV do redis.call('ZADD', tombstones, now_ms + ttl_ms, ARGV[i]) end
redis.call('PUBLISH', channel, '${Nudge.CANCEL}')
return #ARGV - 2
""")
