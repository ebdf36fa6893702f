-- lease.lua: renew a router replica's lease and replace its in-flight load snapshot; drop the
-- load of replicas whose lease ran out (a killed replica leaves nothing behind).
-- The snapshot is the replica's own truth; between snapshots it adds and subtracts with HINCRBY.
--
-- KEYS[1] replicas  ZSET  replica id -> lease deadline (ms, server clock)
-- KEYS[2] inflight  HASH  this replica's load (fields '<r|t|u>:<worker id>')
-- ARGV[1] replica id   ARGV[2] lease ttl_ms (> 0)   ARGV[3] in-flight key prefix
-- ARGV[4..] field, value pairs of the snapshot (counts > 0 only)
-- Returns the number of expired replicas removed (at most 100 per call; UNLINK frees their hashes
-- outside the script, so a large hash costs the call nothing).
local replicas_key, inflight_key = KEYS[1], KEYS[2]
local replica, ttl_ms, inflight_prefix = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

if ttl_ms == nil or ttl_ms <= 0 then
  return redis.error_reply('ERR kvroute: lease ttl_ms must be positive, got ' .. tostring(ARGV[2]))
end
if (#ARGV - 3) % 2 ~= 0 then
  return redis.error_reply('ERR kvroute: lease snapshot needs field, value pairs')
end
redis.call('ZADD', replicas_key, now_ms + ttl_ms, replica)
redis.call('UNLINK', inflight_key)
for i = 4, #ARGV, 2 do
  redis.call('HSET', inflight_key, ARGV[i], ARGV[i + 1])
end
local expired = redis.call('ZRANGEBYSCORE', replicas_key, '-inf', now_ms, 'LIMIT', 0, 100)
for _, dead in ipairs(expired) do
  redis.call('UNLINK', inflight_prefix .. dead)
  redis.call('ZREM', replicas_key, dead)
end
return #expired
