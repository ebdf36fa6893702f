-- settle.lua: the request that was to put these blocks on a worker is past its prefill (its
-- first byte came, or its try failed): where they are still expected on that worker, the
-- expectation lapses within ttl_ms, the time the engine's KV events take to reach the index. Every
-- replica then stops expecting them when the booking one does (an expectation that outlives the
-- index's lag promises blocks a full cache may have evicted since). An entry that names another
-- worker (a later decision) or lapses sooner anyway is left alone, so a replay changes nothing.
--
-- KEYS[1] expected     HASH  block hash (hex) -> worker id
-- KEYS[2] expected_at  ZSET  block hash (hex) -> deadline (ms)
-- ARGV[1] worker id   ARGV[2] ttl_ms (>= 0)   ARGV[3..] block hashes (hex)
-- Returns the number of entries shortened.
local expected_key, deadlines_key = KEYS[1], KEYS[2]
local worker, ttl_ms = ARGV[1], tonumber(ARGV[2])
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

if ttl_ms == nil or ttl_ms < 0 or worker == nil or worker == '' then
  return redis.error_reply('ERR kvroute: settle needs a worker id and a ttl_ms >= 0')
end
local shortened = 0
for i = 3, #ARGV do
  if redis.call('HGET', expected_key, ARGV[i]) == worker then
    local deadline = tonumber(redis.call('ZSCORE', deadlines_key, ARGV[i]))
    if deadline ~= nil and deadline > now_ms + ttl_ms then
      redis.call('ZADD', deadlines_key, now_ms + ttl_ms, ARGV[i])
      shortened = shortened + 1
    end
  end
end
return shortened
