-- expect.lua: remember that a prompt's blocks were just routed to a worker, for ttl_ms, so a
-- burst of identical prompts sees them before the engine's first KV event lands in the index.
-- Also drops lapsed entries (a bounded number per call).
--
-- KEYS[1] expected     HASH  block hash (hex) -> worker id
-- KEYS[2] expected_at  ZSET  block hash (hex) -> deadline (ms)
-- ARGV[1] worker id   ARGV[2] ttl_ms (> 0)   ARGV[3..] block hashes (hex)
-- Returns the number of lapsed entries dropped.
local expected_key, deadlines_key = KEYS[1], KEYS[2]
local worker, ttl_ms = ARGV[1], tonumber(ARGV[2])
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

if ttl_ms == nil or ttl_ms <= 0 or worker == nil or worker == '' then
  return redis.error_reply('ERR kvroute: expect needs a worker id and a positive ttl_ms')
end
for i = 3, #ARGV do
  redis.call('HSET', expected_key, ARGV[i], worker)
  redis.call('ZADD', deadlines_key, now_ms + ttl_ms, ARGV[i])
end
-- Lapsed as expected.lua reads it: a deadline at or before now (a sweep in the same millisecond
-- as a read that found an entry lapsed drops it too).
local lapsed = redis.call('ZRANGEBYSCORE', deadlines_key, '-inf', now_ms, 'LIMIT', 0, 256)
for _, field in ipairs(lapsed) do
  redis.call('HDEL', expected_key, field)
  redis.call('ZREM', deadlines_key, field)
end
return #lapsed
