-- tally.lua: after a round of a writer's apply.lua calls (in the buckets, maybe on other
-- shards), record in the model's own slot what only the writer knows at once: how many blocks
-- the worker's current gid indexes (its mirror's count) and how many distinct block keys the
-- round created minus emptied. `kvroute index` and stats read them from here.
--
-- KEYS[1] record  HASH  the worker's record (fields gid, blocks)
-- KEYS[2] meta    HASH  model settings (field block_keys)
-- ARGV[1] gid   ARGV[2] the gid's indexed blocks (>= 0)   ARGV[3] block keys created minus emptied
-- Returns 'ok', 'missing' or 'superseded' (the count is not the current gid's: left out).
local record_key, meta_key = KEYS[1], KEYS[2]
local gid, blocks, key_delta = ARGV[1], ARGV[2], tonumber(ARGV[3])
if blocks == nil or not string.match(blocks, '^%d+$') or key_delta == nil or key_delta % 1 ~= 0 then
  return redis.error_reply('ERR kvroute: tally needs a non-negative block count and an integer key delta, got '
    .. tostring(ARGV[2]) .. ', ' .. tostring(ARGV[3]))
end
if key_delta ~= 0 then
  redis.call('HINCRBY', meta_key, 'block_keys', key_delta)
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
