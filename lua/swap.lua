-- swap.lua: make a worker's staged gid (stage.lua, then filled by apply.lua) its current one and
-- retire the old gid, in one step: readers see the old generation until now, the new one after.
-- The new gid is alive until now + ttl_ms, and the worker's epoch counts one more registration.
--
-- KEYS[1] workers  HASH  worker_id -> current gid
-- KEYS[2] alive    ZSET  gid -> heartbeat deadline (ms)
-- KEYS[3] retired  ZSET  gid -> retirement time (ms)
-- KEYS[4] record   HASH  the worker's record
-- KEYS[5] alive_version STRING  the version of `alive`'s membership (alive_since.lua)
-- ARGV[1] worker_id   ARGV[2] the caller's current gid   ARGV[3] the staged gid   ARGV[4] ttl_ms (>= 0)
-- ARGV[5] the staged gid's indexed blocks (>= 0)
-- Returns {'ok', epoch}, {'missing', 0}, {'superseded', 0}, or {'expired', 0} when the stage is
-- gone (replaced, discarded by a registration, or past its staging time, when gc may collect it).
local workers_key, alive_key, retired_key, record_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local worker_id, current_gid, staged, ttl_ms, blocks = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
-- A new version of who is alive (alive_since.lua): the server's clock in microseconds, or one
-- more than the last version if the clock stands still or went back, so a version is never
-- handed out twice, even after Redis lost the key.
local function bump_alive_version()
  local last = tonumber(redis.call('GET', KEYS[5]) or '0') or 0
  local now_us = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
  redis.call('SET', KEYS[5], string.format('%d', math.max(now_us, last + 1)))
end

if ttl_ms == nil or ttl_ms < 0 then
  return redis.error_reply('ERR kvroute: ttl_ms must be a non-negative number, got ' .. tostring(ARGV[4]))
end
if blocks == nil or blocks < 0 or blocks % 1 ~= 0 then
  return redis.error_reply('ERR kvroute: swap blocks must be a non-negative integer, got ' .. tostring(ARGV[5]))
end
local record = redis.call('HMGET', record_key, 'gid', 'pending')
if not record[1] then
  return {'missing', 0}
end
if record[1] ~= current_gid then
  return {'superseded', 0}
end
local staged_until = redis.call('ZSCORE', retired_key, staged)
if record[2] ~= staged or not staged_until or tonumber(staged_until) <= now_ms then
  return {'expired', 0}
end
redis.call('ZREM', alive_key, current_gid)
redis.call('ZADD', retired_key, now_ms, current_gid)
redis.call('ZREM', retired_key, staged)
redis.call('ZADD', alive_key, now_ms + ttl_ms, staged)
bump_alive_version()
redis.call('HSET', workers_key, worker_id, staged)
local epoch = redis.call('HINCRBY', record_key, 'epoch', 1)
redis.call('HSET', record_key, 'gid', staged, 'blocks', blocks, 'registered_ms', now_ms,
  'heartbeat_ms', now_ms, 'ttl_ms', ttl_ms)
redis.call('HDEL', record_key, 'pending')
return {'ok', epoch}
