-- heartbeat.lua: keep a worker alive until now + ttl_ms (server clock).
-- A ttl of 0 marks the worker not alive at once (used for a graceful pause and by tests).
--
-- KEYS[1] record  HASH  the worker's record
-- KEYS[2] alive   ZSET  gid -> heartbeat deadline (ms)
-- KEYS[3] alive_version STRING  the version of `alive`'s membership (alive_since.lua)
-- ARGV[1] gid     the generation the caller registered; ARGV[2] ttl_ms (integer, 0..86400000)
-- Returns 'ok', 'missing' (no record: Redis lost data or gc removed a long-dead worker; the
-- caller must register again and re-assert its blocks) or 'superseded' (another registration
-- of the same worker id took over; the caller must stop writing).
local record_key, alive_key = KEYS[1], KEYS[2]
local gid, ttl_ms = ARGV[1], tonumber(ARGV[2])
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
-- A new version of who is alive (alive_since.lua): the server's clock in microseconds, or one
-- more than the last version if the clock stands still or went back, so a version is never
-- handed out twice, even after Redis lost the key.
local function bump_alive_version()
  local last = tonumber(redis.call('GET', KEYS[3]) or '0') or 0
  local now_us = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
  redis.call('SET', KEYS[3], string.format('%d', math.max(now_us, last + 1)))
end

-- 'inf' and 'nan' parse as numbers in Lua: an infinite TTL would keep a dead worker alive forever.
if ttl_ms == nil or ttl_ms ~= ttl_ms or ttl_ms < 0 or ttl_ms > 86400000 or ttl_ms % 1 ~= 0 then
  return redis.error_reply('ERR kvroute: ttl_ms must be an integer from 0 to 86400000 (one day), got '
    .. tostring(ARGV[2]))
end
local current = redis.call('HGET', record_key, 'gid')
if not current then
  return 'missing'
end
if current ~= gid then
  return 'superseded'
end
-- Pushing a live deadline later changes nobody's liveness; anything else may.
local deadline = tonumber(redis.call('ZSCORE', alive_key, gid))
if deadline == nil or deadline <= now_ms or now_ms + ttl_ms < deadline then
  bump_alive_version()
end
redis.call('ZADD', alive_key, now_ms + ttl_ms, gid)
redis.call('HSET', record_key, 'heartbeat_ms', now_ms, 'ttl_ms', ttl_ms)
return 'ok'
