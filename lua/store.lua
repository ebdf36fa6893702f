-- store.lua: index a batch of blocks for one worker generation (gid).
-- Each block key is a ZSET member=gid, score=reference count (vLLM stores a second copy of a
-- block it already holds and later sends one BlockRemoved per copy).
-- The index stays prefix-closed: a block is accepted only when its parent is indexed for the
-- same gid (or it is a chain's first block), so match.lua can search over depth exactly.
-- Idempotent: each call carries an op id that must exceed the last one applied for the gid;
-- a replayed call (same op id) changes nothing and returns 'dup'.
--
-- KEYS[1] record  HASH    the worker's record (fields gid, op, blocks)
-- KEYS[2] log     STRING  8-byte hashes of blocks that joined this gid, in order (gc.lua reads it)
-- KEYS[3] meta    HASH    model settings (field block_keys counts distinct block keys)
-- ARGV[1] gid   ARGV[2] op id (integer > last op)   ARGV[3] block key prefix
-- ARGV[4] hashes  8 bytes big-endian per item
-- ARGV[5] parent flags, one char per item: 'r' chain start, 'c' parent is the previous item,
--         'p' parent is the next 8 bytes of ARGV[7]
-- ARGV[6] counts, 2 bytes big-endian per item (1..65535 copies)
-- ARGV[7] explicit parents, 8 bytes big-endian each, one per 'p' flag
-- Returns {'ok'|'dup', accepted, skipped (parent not indexed), new entries, log entries}.
local record_key, log_key, meta_key = KEYS[1], KEYS[2], KEYS[3]
local gid, op_id, block_prefix = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local hashes, flags, counts, parents = ARGV[4], ARGV[5], ARGV[6], ARGV[7]
local n = #hashes / 8
local HEX = '%02x%02x%02x%02x%02x%02x%02x%02x'
local accepted, skipped, added, new_key_count = 0, 0, 0, 0
local appended = {}
local parent_pos = 1
local previous_ok = false

if op_id == nil or op_id % 1 ~= 0 then
  return redis.error_reply('ERR kvroute: store op id must be an integer, got ' .. tostring(ARGV[2]))
end
if n % 1 ~= 0 or #flags ~= n or #counts ~= 2 * n or #parents % 8 ~= 0 then
  return redis.error_reply('ERR kvroute: store arguments malformed: ' .. #hashes .. ' hash bytes, '
    .. #flags .. ' flags, ' .. #counts .. ' count bytes, ' .. #parents .. ' parent bytes')
end
if string.find(flags, '[^rcp]') or string.sub(flags, 1, 1) == 'c' then
  return redis.error_reply('ERR kvroute: store flags must be r, c or p, and the first may not be c')
end
local _, p_flags = string.gsub(flags, 'p', 'p')
if p_flags * 8 ~= #parents then
  return redis.error_reply('ERR kvroute: store has ' .. p_flags .. " 'p' flags but " .. #parents / 8 .. ' parents')
end
local current = redis.call('HGET', record_key, 'gid')
if current ~= gid then
  return redis.error_reply('ERR kvroute: stale generation: gid ' .. gid .. ' is not current (current: '
    .. tostring(current) .. ')')
end
if op_id <= tonumber(redis.call('HGET', record_key, 'op') or '0') then
  return {'dup', 0, 0, 0, 0}
end

for i = 0, n - 1 do
  local flag = string.sub(flags, i + 1, i + 1)
  local count = string.byte(counts, 2 * i + 1) * 256 + string.byte(counts, 2 * i + 2)
  local parent_ok
  if flag == 'r' then
    parent_ok = true
  elseif flag == 'c' then
    parent_ok = previous_ok
  else
    local parent_key = block_prefix .. string.format(HEX, string.byte(parents, parent_pos, parent_pos + 7))
    parent_pos = parent_pos + 8
    parent_ok = redis.call('ZSCORE', parent_key, gid) ~= false
  end
  if parent_ok and count > 0 then
    local raw = string.sub(hashes, 8 * i + 1, 8 * i + 8)
    local key = block_prefix .. string.format(HEX, string.byte(raw, 1, 8))
    if tonumber(redis.call('ZINCRBY', key, count, gid)) == count then
      added = added + 1
      appended[added] = raw
      if redis.call('ZCARD', key) == 1 then
        new_key_count = new_key_count + 1
      end
    end
    accepted = accepted + 1
    previous_ok = true
  else
    skipped = skipped + 1
    previous_ok = false
  end
end

local log_len = redis.call('STRLEN', log_key)
if added > 0 then
  log_len = redis.call('APPEND', log_key, table.concat(appended))
  redis.call('HINCRBY', record_key, 'blocks', added)
end
if new_key_count > 0 then
  redis.call('HINCRBY', meta_key, 'block_keys', new_key_count)
end
redis.call('HSET', record_key, 'op', op_id)
return {'ok', accepted, skipped, added, log_len / 8}
