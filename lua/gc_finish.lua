-- gc_finish.lua: forget a retired gid once gc_bucket.lua has collected it in every bucket it had
-- entries in: its `gids` entry (the name routers cache), its `retired` entry and its bucket list.
-- A gid still staged for a re-assert (retired with a score in the future) is left alone.
--
-- KEYS[1] gids     HASH  gid -> worker_id
-- KEYS[2] retired  ZSET  gid -> retirement time (ms)
-- KEYS[3] buckets  SET   the buckets the gid has entries in
-- ARGV[1] gid
-- Returns 1 if the gid was forgotten, else 0.
local gids_key, retired_key, buckets_key = KEYS[1], KEYS[2], KEYS[3]
local gid = ARGV[1]
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local since = tonumber(redis.call('ZSCORE', retired_key, gid))
if since == nil or since > now_ms then
  return 0
end
redis.call('HDEL', gids_key, gid)
redis.call('ZREM', retired_key, gid)
redis.call('DEL', buckets_key)
return 1
