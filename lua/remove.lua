-- remove.lua: drop copies of blocks from one worker generation (gid).
-- A block leaves the gid's set only when its reference count reaches 0 (Redis deletes a ZSET
-- when its last member goes). The caller sends a chain's descendants before their ancestor so the
-- index stays prefix-closed (kvindex.mirror orders removals that way).
-- Idempotent through the op id, exactly like store.lua.
--
-- KEYS[1] record  HASH  the worker's record (fields gid, op, blocks)
-- KEYS[2] meta    HASH  model settings (field block_keys counts distinct block keys)
-- ARGV[1] gid   ARGV[2] op id (integer > last op)   ARGV[3] block key prefix
-- ARGV[4] hashes  8 bytes big-endian per item
-- ARGV[5] counts  2 bytes big-endian per item (copies to drop)
-- Returns {'ok'|'dup', applied, missing (not indexed for the gid), entries removed}.
local record_key, meta_key = KEYS[1], KEYS[2]
local gid, op_id, block_prefix = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local hashes, counts = ARGV[4], ARGV[5]
local n = #hashes / 8
local HEX = '%02x%02x%02x%02x%02x%02x%02x%02x'
local applied, missing, removed, gone_keys = 0, 0, 0, 0

if op_id == nil or op_id % 1 ~= 0 then
  return redis.error_reply('ERR kvroute: remove op id must be an integer, got ' .. tostring(ARGV[2]))
end
if n % 1 ~= 0 or #counts ~= 2 * n then
  return redis.error_reply('ERR kvroute: remove arguments malformed: ' .. #hashes .. ' hash bytes, '
    .. #counts .. ' count bytes')
end
local current = redis.call('HGET', record_key, 'gid')
if current ~= gid then
  return redis.error_reply('ERR kvroute: stale generation: gid ' .. gid .. ' is not current (current: '
    .. tostring(current) .. ')')
end
if op_id <= tonumber(redis.call('HGET', record_key, 'op') or '0') then
  return {'dup', 0, 0, 0}
end

for i = 0, n - 1 do
  local key = block_prefix .. string.format(HEX, string.byte(hashes, 8 * i + 1, 8 * i + 8))
  local count = string.byte(counts, 2 * i + 1) * 256 + string.byte(counts, 2 * i + 2)
  local score = redis.call('ZSCORE', key, gid)
  if not score then
    missing = missing + 1
  else
    applied = applied + 1
    if tonumber(score) - count <= 0 then
      redis.call('ZREM', key, gid)
      removed = removed + 1
      if redis.call('EXISTS', key) == 0 then
        gone_keys = gone_keys + 1
      end
    else
      redis.call('ZINCRBY', key, -count, gid)
    end
  end
end

if removed > 0 then
  redis.call('HINCRBY', record_key, 'blocks', -removed)
end
if gone_keys > 0 then
  redis.call('HINCRBY', meta_key, 'block_keys', -gone_keys)
end
redis.call('HSET', record_key, 'op', op_id)
return {'ok', applied, missing, removed}
