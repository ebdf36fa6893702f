-- tally.lua: after a writer's page_apply.lua calls (in the buckets, maybe on other shards),
-- record in the model's own slot what only the writer knows at once: how many blocks the
-- worker's current gid indexes (its mirror's count) and how many pages its calls gave their
-- first holder minus took the last one from. `kvroute index` and stats read them from here.
--
-- KEYS[1] record  HASH  the worker's record (fields gid, blocks)
-- KEYS[2] meta    HASH  model settings (field pages)
-- ARGV[1] gid   ARGV[2] the gid's indexed blocks (>= 0)   ARGV[3] pages created minus emptied
-- Returns 'ok', 'missing' or 'superseded' (the count is not the current gid's: left out).
local record_key, meta_key = KEYS[1], KEYS[2]
local gid, blocks, key_delta = ARGV[1], ARGV[2], tonumber(ARGV[3])
if blocks == nil or not string.match(blocks, '^%d+$') or key_delta == nil or key_delta % 1 ~= 0 then
  return redis.error_reply('ERR kvroute: tally needs a non-negative block count and an integer page delta, got '
    .. tostring(ARGV[2]) .. ', ' .. tostring(ARGV[3]))
end
if key_delta ~= 0 then
  redis.call('HINCRBY', meta_key, 'pages', key_delta)
end
local current = redis.call('HGET', record_key, 'gid')
if not current then
  return 'missing'
end
if current ~= gid then
  return 'superseded'
end
redis.call('HSET', record_key, 'blocks', blocks)
return 'ok'
