-- apply.lua: apply one ordered list of index changes to one worker generation (gid), atomically.
-- A change list is a sequence of segments, each either additions ('a') or subtractions ('s');
-- an engine batch (or several consecutive ones) becomes one call, so routers never see half of it.
--
-- Additions: each block key is a SET of the gids that hold the block (copies are counted by the
-- writer's mirror, which adds a block when it becomes indexed and subtracts it when it stops
-- being indexed). A block is accepted only when its parent is indexed for the same gid (or it is
-- a chain's first block). match.lua does not rely on that: it reads a gid's presence at every
-- depth it credits.
-- Subtractions: the gid leaves the block's set (Redis deletes an empty set). The caller sends a
-- chain's descendants before their ancestor (kvindex.mirror does).
-- Idempotent: each call carries an op id that must exceed the last one applied for the gid;
-- a replayed call (same op id) changes nothing and returns 'dup'.
--
-- The gid is the worker's current one, or the one staged for its re-assert (stage.lua), whose
-- op id and block count are kept in the record's pending_op and pending_blocks until swap.lua.
-- KEYS[1] record  HASH    the worker's record (fields gid, op, blocks; pending, pending_op, pending_blocks)
-- KEYS[2] log     STRING  8-byte hashes of blocks that joined this gid, in order (gc.lua reads it)
-- KEYS[3] meta    HASH    model settings (field block_keys counts distinct block keys)
-- ARGV[1] gid   ARGV[2] op id (integer > last op)   ARGV[3] block key prefix
-- ARGV[4] segment kinds, one char per segment: 'a' or 's'; then per segment, in order:
--   'a': hashes (8 bytes big-endian per item), parent flags (one char per item: 'r' chain start,
--        'c' parent is the previous item of the segment, 'p' parent is the next 8 bytes of the
--        explicit parents), explicit parents
--   's': hashes (8 bytes big-endian per item)
-- Returns {'ok'|'dup', accepted, skipped (parent not indexed), new entries, log entries,
--          subtracted, missing (not indexed for the gid), entries removed}; an accepted block
-- the gid held already is no new entry, and every subtracted block is a removed entry.
local record_key, log_key, meta_key = KEYS[1], KEYS[2], KEYS[3]
local gid, op_id, block_prefix, kinds = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local HEX = '%02x%02x%02x%02x%02x%02x%02x%02x'
local accepted, skipped, added, new_keys = 0, 0, 0, 0
local missing, removed, gone_keys = 0, 0, 0
local appended = {}

local function block_key(bytes, pos)
  return block_prefix .. string.format(HEX, string.byte(bytes, pos, pos + 7))
end

local function check_adds(hashes, flags, parents)
  local n = #hashes / 8
  if n % 1 ~= 0 or #flags ~= n or #parents % 8 ~= 0 then
    return 'arguments malformed: ' .. #hashes .. ' hash bytes, ' .. #flags .. ' flags, '
      .. #parents .. ' parent bytes'
  end
  if string.find(flags, '[^rcp]') or string.sub(flags, 1, 1) == 'c' then
    return 'parent flags must be r, c or p, and the first may not be c'
  end
  local _, p_flags = string.gsub(flags, 'p', 'p')
  if p_flags * 8 ~= #parents then
    return p_flags .. " 'p' flags but " .. #parents / 8 .. ' parents'
  end
  return nil
end

local function check_subs(hashes)
  if #hashes % 8 ~= 0 then
    return 'arguments malformed: ' .. #hashes .. ' hash bytes'
  end
  return nil
end

local function apply_adds(hashes, flags, parents)
  local parent_pos, previous_ok = 1, false
  for i = 0, #hashes / 8 - 1 do
    local flag, parent_ok = string.sub(flags, i + 1, i + 1), false
    if flag == 'r' then
      parent_ok = true
    elseif flag == 'c' then
      parent_ok = previous_ok
    else
      parent_ok = redis.call('SISMEMBER', block_key(parents, parent_pos), gid) == 1
      parent_pos = parent_pos + 8
    end
    if parent_ok then
      local key = block_key(hashes, 8 * i + 1)
      if redis.call('SADD', key, gid) == 1 then
        added = added + 1
        appended[added] = string.sub(hashes, 8 * i + 1, 8 * i + 8)
        if redis.call('SCARD', key) == 1 then
          new_keys = new_keys + 1
        end
      end
      accepted = accepted + 1
      previous_ok = true
    else
      skipped = skipped + 1
      previous_ok = false
    end
  end
end

local function apply_subs(hashes)
  for i = 0, #hashes / 8 - 1 do
    local key = block_key(hashes, 8 * i + 1)
    if redis.call('SREM', key, gid) == 1 then
      removed = removed + 1
      if redis.call('EXISTS', key) == 0 then
        gone_keys = gone_keys + 1
      end
    else
      missing = missing + 1
    end
  end
end

if op_id == nil or op_id % 1 ~= 0 then
  return redis.error_reply('ERR kvroute: apply op id must be an integer, got ' .. tostring(ARGV[2]))
end
if string.find(kinds, '[^as]') then
  return redis.error_reply("ERR kvroute: apply segment kinds must be 'a' or 's', got " .. kinds)
end
local arg, problem = 5, nil
for k = 1, #kinds do
  if string.sub(kinds, k, k) == 'a' then
    problem = check_adds(ARGV[arg] or '', ARGV[arg + 1] or '', ARGV[arg + 2] or '')
    arg = arg + 3
  else
    problem = check_subs(ARGV[arg] or '')
    arg = arg + 1
  end
  if problem then
    return redis.error_reply('ERR kvroute: apply segment ' .. k .. ': ' .. problem)
  end
end
if arg - 1 ~= #ARGV then
  return redis.error_reply('ERR kvroute: apply arguments malformed: segments ' .. kinds .. ' need '
    .. (arg - 1) .. ' arguments, got ' .. #ARGV)
end
local current = redis.call('HGET', record_key, 'gid')
local op_field, blocks_field = 'op', 'blocks'
if current ~= gid then
  if redis.call('HGET', record_key, 'pending') ~= gid then
    return redis.error_reply('ERR kvroute: stale generation: gid ' .. gid .. ' is not current (current: '
      .. tostring(current) .. ')')
  end
  op_field, blocks_field = 'pending_op', 'pending_blocks'  -- a re-assert fills its staged gid
end
if op_id <= tonumber(redis.call('HGET', record_key, op_field) or '0') then
  return {'dup', 0, 0, 0, 0, 0, 0, 0}
end

arg = 5
for k = 1, #kinds do
  if string.sub(kinds, k, k) == 'a' then
    apply_adds(ARGV[arg], ARGV[arg + 1], ARGV[arg + 2])
    arg = arg + 3
  else
    apply_subs(ARGV[arg])
    arg = arg + 1
  end
end

local log_len = redis.call('STRLEN', log_key)
if added > 0 then
  log_len = redis.call('APPEND', log_key, table.concat(appended))
end
if added - removed ~= 0 then
  redis.call('HINCRBY', record_key, blocks_field, added - removed)
end
if new_keys - gone_keys ~= 0 then
  redis.call('HINCRBY', meta_key, 'block_keys', new_keys - gone_keys)
end
redis.call('HSET', record_key, op_field, op_id)
return {'ok', accepted, skipped, added, log_len / 8, removed, missing, removed}
