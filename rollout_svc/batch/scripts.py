"""The batch store's Lua scripts (run by `batch.store`), rendered once at import.

Each declares every key it touches in KEYS and binds its KEYS and ARGV to named locals first; the one hash field
a script writes (a `BatchField` counter) comes in ARGV, from the constant.
"""

from rollout_svc.keys import lua

# KEYS: [1] output hash, [2] batch hash. ARGV: [1] custom_id, [2] its output line, [3] the counter to count it in
# (`BatchField.COMPLETED` or `FAILED`). Records a line's output once: HSETNX, and counts it only if it was new.
# Returns 1, or 0 if the line was recorded already.
RECORD_LUA = lua("""
local outputs, batch = KEYS[1], KEYS[2]
local custom_id, line, counter = ARGV[1], ARGV[2], ARGV[3]
if redis.call('HSETNX', outputs, custom_id, line) == 1 then
  redis.call('HINCRBY', batch, counter, 1)
  return 1
end
return 0
""")

# KEYS: [1] the lease. ARGV: [1] this run's token, [2] ttl ms (0: release). Refreshes or releases the lease only if
# this run holds it. Returns 1, or 0 if it does not.
LEASE_LUA = lua("""
local lease, token, ttl_ms = KEYS[1], ARGV[1], ARGV[2]
if redis.call('GET', lease) ~= token then return 0 end
if tonumber(ttl_ms) > 0 then redis.call('PEXPIRE', lease, ttl_ms) else redis.call('DEL', lease) end
return 1
""")
