-- load.lua: record a worker's load signal (scraped from its engine's /metrics) for the routers.
-- Writes only into the current generation's record, so a late report can never resurrect a
-- deregistered or garbage-collected worker.
--
-- KEYS[1] record  HASH  the worker's record
-- ARGV[1] gid   ARGV[2] running requests (>= 0)   ARGV[3] waiting requests (>= 0)
-- ARGV[4] KV cache usage (0..1)   ARGV[5] optional: the engine's cache size in blocks (>= 1)
-- Returns 'ok', 'missing' or 'superseded' (as heartbeat.lua).
local record_key = KEYS[1]
local gid = ARGV[1]
local running, waiting, kv_usage = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

if running == nil or running < 0 or waiting == nil or waiting < 0 then
  return redis.error_reply('ERR kvroute: load needs non-negative running and waiting counts, got '
    .. tostring(ARGV[2]) .. ', ' .. tostring(ARGV[3]))
end
if kv_usage == nil or kv_usage < 0 or kv_usage > 1 then
  return redis.error_reply('ERR kvroute: load kv_usage must be within 0..1, got ' .. tostring(ARGV[4]))
end
local capacity = ARGV[5]
if capacity ~= nil and (tonumber(capacity) == nil or tonumber(capacity) < 1 or tonumber(capacity) % 1 ~= 0) then
  return redis.error_reply('ERR kvroute: load capacity must be a positive integer, got ' .. tostring(capacity))
end
local current = redis.call('HGET', record_key, 'gid')
if not current then
  return 'missing'
end
if current ~= gid then
  return 'superseded'
end
redis.call('HSET', record_key, 'running', ARGV[2], 'waiting', ARGV[3], 'kv_usage', ARGV[4], 'load_ms', now_ms)
if capacity ~= nil then
  redis.call('HSET', record_key, 'capacity_blocks', capacity)
end
return 'ok'
