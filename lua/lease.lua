-- lease.lua: renew a router replica's lease and replace its in-flight load snapshot; forget the
-- replicas whose lease ran out. The snapshot is the replica's own truth; between snapshots it
-- adds and subtracts with HINCRBY. A replica's hash expires by itself (expire_ms, several lease
-- periods), so a killed replica leaves nothing behind and no script touches another's hash.
--
-- KEYS[1] replicas  ZSET  replica id -> lease deadline (ms, server clock)
-- KEYS[2] inflight  HASH  this replica's load (fields '<r|t|u|a>:<worker id>')
-- ARGV[1] replica id   ARGV[2] lease ttl_ms (> 0)   ARGV[3] expire_ms (>= ttl_ms)
-- ARGV[4..] field, value pairs of the snapshot (counts > 0 only)
-- Returns {expired replicas forgotten (at most 100 per call), live replica id, ...}: readers
-- declare the live replicas' hashes (inflight.lua).
local replicas_key, inflight_key = KEYS[1], KEYS[2]
local replica, ttl_ms, expire_ms = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

if ttl_ms == nil or ttl_ms <= 0 or expire_ms == nil or expire_ms < ttl_ms then
  return redis.error_reply('ERR kvroute: lease ttl_ms must be positive and expire_ms at least ttl_ms, got '
    .. tostring(ARGV[2]) .. ', ' .. tostring(ARGV[3]))
end
if (#ARGV - 3) % 2 ~= 0 then
  return redis.error_reply('ERR kvroute: lease snapshot needs field, value pairs')
end
redis.call('ZADD', replicas_key, now_ms + ttl_ms, replica)
redis.call('UNLINK', inflight_key)
for i = 4, #ARGV, 2 do
  redis.call('HSET', inflight_key, ARGV[i], ARGV[i + 1])
end
if #ARGV > 3 then
  redis.call('PEXPIRE', inflight_key, expire_ms)
end
local expired = redis.call('ZRANGEBYSCORE', replicas_key, '-inf', now_ms, 'LIMIT', 0, 100)
if #expired > 0 then
  redis.call('ZREM', replicas_key, unpack(expired))
end
local out = redis.call('ZREVRANGEBYSCORE', replicas_key, '+inf', '(' .. now_ms, 'LIMIT', 0, 64)
table.insert(out, 1, #expired)
return out
