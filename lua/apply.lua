-- apply.lua: apply one ordered list of index changes of one worker generation (gid) in one
-- bucket (kvindex.keys: a bucket holds whole chains, so a match reads one bucket), atomically.
-- A change list is a sequence of segments, each either additions ('a') or subtractions ('s');
-- an engine batch's changes in this bucket (or several consecutive batches') become one call,
-- so routers never see half of it.
--
-- Additions: each block key is a SET of the gids that hold the block (copies are counted by the
-- writer's mirror). A block is accepted only when its parent is indexed for the same gid (or it
-- is a chain's first block); match.lua does not rely on that, it reads a gid's presence at every
-- depth it credits. Subtractions: the gid leaves the block's set (Redis deletes an empty set);
-- the caller sends a chain's descendants before their ancestor (kvindex.mirror does).
--
-- Continuity, per (gid, bucket): the state's `op` is the id of the last call applied. A call
-- names the op id it follows (the previous call this writer sent to this bucket, 0 for none):
-- a state that does not end there lost writes (a failover to a replica that lacked them, a
-- flush), and the call is refused with 'lost' so that the writer re-asserts the worker. A call
-- whose op id was applied already (a client retry) changes nothing: 'dup'. A gid that gc has
-- collected in this bucket is 'dead': a stale writer cannot leave entries that nothing collects.
--
-- KEYS[1] state  HASH    the gid's state in this bucket: op, n (entries); dead once collected
-- KEYS[2] log    STRING  8-byte hashes of blocks that joined the gid in this bucket, in order
-- KEYS[3..] block keys, segment by segment: an 'a' segment's items, then the parents of its
--           items flagged 'p' (in order); an 's' segment's items
-- ARGV[1] gid   ARGV[2] previous op id   ARGV[3] op id (integer > previous)
-- ARGV[4] segment kinds, one char per segment: 'a' or 's'; ARGV[5..] per segment, in order:
--   'a': hashes (8 bytes big-endian per item, for the log), parent flags (one char per item:
--        'r' chain start, 'c' parent is the previous item of the segment, 'p' parent is the
--        next declared parent key)
--   's': the number of items
-- Returns {'ok'|'dup'|'lost'|'dead', accepted, skipped (parent not indexed), new entries,
--          log entries, subtracted, missing (not indexed for the gid), block keys created minus
--          block keys emptied, the gid's entries in this bucket}.
local state_key, log_key = KEYS[1], KEYS[2]
local gid, previous_op, op_id, kinds = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local accepted, skipped, added, new_keys = 0, 0, 0, 0
local missing, removed, gone_keys = 0, 0, 0
local appended = {}

local function check_adds(hashes, flags)
  local n = #hashes / 8
  if n % 1 ~= 0 or #flags ~= n then
    return 'arguments malformed: ' .. #hashes .. ' hash bytes, ' .. #flags .. ' flags', 0
  end
  if string.find(flags, '[^rcp]') or string.sub(flags, 1, 1) == 'c' then
    return 'parent flags must be r, c or p, and the first may not be c', 0
  end
  local _, p_flags = string.gsub(flags, 'p', 'p')
  return nil, n + p_flags
end

local function apply_adds(hashes, flags, key_pos)
  local n = #hashes / 8
  local parent_pos, previous_ok = key_pos + n, false
  for i = 0, n - 1 do
    local flag, parent_ok = string.sub(flags, i + 1, i + 1), false
    if flag == 'r' then
      parent_ok = true
    elseif flag == 'c' then
      parent_ok = previous_ok
    else
      parent_ok = redis.call('SISMEMBER', KEYS[parent_pos], gid) == 1
      parent_pos = parent_pos + 1
    end
    if parent_ok then
      local key = KEYS[key_pos + i]
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
  return parent_pos
end

local function apply_subs(count, key_pos)
  for i = 0, count - 1 do
    local key = KEYS[key_pos + i]
    if redis.call('SREM', key, gid) == 1 then
      removed = removed + 1
      if redis.call('EXISTS', key) == 0 then
        gone_keys = gone_keys + 1
      end
    else
      missing = missing + 1
    end
  end
  return key_pos + count
end

if op_id == nil or op_id % 1 ~= 0 or previous_op == nil or previous_op % 1 ~= 0 or op_id <= previous_op then
  return redis.error_reply('ERR kvroute: apply op ids must be integers, op > previous op, got '
    .. tostring(ARGV[3]) .. ' after ' .. tostring(ARGV[2]))
end
if string.find(kinds, '[^as]') then
  return redis.error_reply("ERR kvroute: apply segment kinds must be 'a' or 's', got " .. kinds)
end
local arg, keys_needed, problem = 5, 2, nil
for k = 1, #kinds do
  local used = 0
  if string.sub(kinds, k, k) == 'a' then
    problem, used = check_adds(ARGV[arg] or '', ARGV[arg + 1] or '')
    arg = arg + 2
  else
    used = tonumber(ARGV[arg] or '')
    if used == nil or used < 0 or used % 1 ~= 0 then
      problem, used = 'subtraction count must be a non-negative integer', 0
    end
    arg = arg + 1
  end
  if problem then
    return redis.error_reply('ERR kvroute: apply segment ' .. k .. ': ' .. problem)
  end
  keys_needed = keys_needed + used
end
if arg - 1 ~= #ARGV or keys_needed ~= #KEYS then
  return redis.error_reply('ERR kvroute: apply arguments malformed: segments ' .. kinds .. ' need '
    .. (arg - 1) .. ' arguments and ' .. keys_needed .. ' keys, got ' .. #ARGV .. ' and ' .. #KEYS)
end
local state = redis.call('HMGET', state_key, 'op', 'n', 'dead')
local last_op, entries = tonumber(state[1] or '0'), tonumber(state[2] or '0')
local log_len = redis.call('STRLEN', log_key) / 8
if state[3] then
  return {'dead', 0, 0, 0, log_len, 0, 0, 0, 0}
end
if last_op >= op_id then
  return {'dup', 0, 0, 0, log_len, 0, 0, 0, entries}
end
if last_op ~= previous_op then
  return {'lost', 0, 0, 0, log_len, 0, 0, 0, entries}
end

arg = 5
local key_pos = 3
for k = 1, #kinds do
  if string.sub(kinds, k, k) == 'a' then
    key_pos = apply_adds(ARGV[arg], ARGV[arg + 1], key_pos)
    arg = arg + 2
  else
    key_pos = apply_subs(tonumber(ARGV[arg]), key_pos)
    arg = arg + 1
  end
end

if added > 0 then
  log_len = redis.call('APPEND', log_key, table.concat(appended)) / 8
end
entries = entries + added - removed
redis.call('HSET', state_key, 'op', op_id, 'n', entries)
return {'ok', accepted, skipped, added, log_len, removed, missing, new_keys - gone_keys, entries}
