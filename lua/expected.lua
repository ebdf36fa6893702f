#!lua flags=no-writes
-- expected.lua: which worker each given block was just routed to, if that is still fresh.
-- Read-only.
--
-- KEYS[1] expected     HASH  block hash (hex) -> worker id
-- KEYS[2] expected_at  ZSET  block hash (hex) -> deadline (ms)
-- ARGV[1..] block hashes (hex)
-- Returns one entry per hash: the worker id, or false when none or lapsed.
local expected_key, deadlines_key = KEYS[1], KEYS[2]
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local out = {}

for i = 1, #ARGV do
  local deadline = tonumber(redis.call('ZSCORE', deadlines_key, ARGV[i]))
  if deadline ~= nil and deadline > now_ms then
    out[i] = redis.call('HGET', expected_key, ARGV[i])
  else
    out[i] = false
  end
end
return out
