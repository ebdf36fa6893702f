-- page_apply.lua: one worker generation's (gid's) changes to its holdings in the pages of one
-- bucket, atomically (docs/index-schema.md, "The next layout"). A holding says "the gid holds
-- the page's blocks from its first through this leaf"; the writer's mirror computes which
-- leaves a gid gains and loses in each page, so a write costs per page, not per block.
--
-- A page key is a HASH: `h` the gids with a holding in the page; `e:<leaf>` the gids whose
-- holding ends at that leaf; `t:<leaf>` the branch from the page's first block to the leaf
-- (16 hex digits a block, the same for every holder: block hashes are chained); `g:<gid>` the
-- gid's leaves. Lists are `,item,item,`. A leaf nobody holds loses its `e:` and `t:` fields,
-- and a page nobody holds is deleted (Redis drops an empty HASH).
--
-- Continuity, per (gid, bucket), as apply.lua: the state's `op` is the id of the last call
-- applied; a call names the op id it follows. Not that one: 'lost' (the bucket lost writes; the
-- writer re-asserts). Applied already: 'dup', nothing changes. Collected by gc: 'dead'.
--
-- KEYS[1] state  HASH    the gid's state in this bucket: op, n (its indexed blocks here); dead
-- KEYS[2] log    STRING  8-byte first-block hashes of the pages the gid came to hold, in order
-- KEYS[3..] page keys, each once
-- ARGV[1] gid   ARGV[2] previous op id   ARGV[3] op id (integer > previous)
-- ARGV[4] the change in the gid's indexed blocks in this bucket (the mirror counts them)
-- ARGV[5] the pages' first-block hashes, 8 bytes big-endian each, in KEYS order (for the log)
-- ARGV[6..] per page, in KEYS order: leaves gained g, leaves lost l, then g pairs (leaf hex,
--           branch hex), then l leaf hexes
-- Returns {'ok'|'dup'|'lost'|'dead', leaves gained, leaves lost, lost leaves it did not hold,
--          log entries, pages created minus pages emptied, the gid's blocks in this bucket}.
local state_key, log_key = KEYS[1], KEYS[2]
local gid, previous_op, op_id, delta = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local starts = ARGV[5]
local pages = #KEYS - 2

local function integer(x)
  return x ~= nil and x % 1 == 0
end
if not (integer(op_id) and integer(previous_op) and integer(delta)) or op_id <= previous_op then
  return redis.error_reply('ERR kvroute: page_apply op ids and block delta must be integers, op > previous op')
end
if not string.match(gid, '^%d+$') or #starts ~= 8 * pages then
  return redis.error_reply('ERR kvroute: page_apply needs a decimal gid and 8 bytes of first block per page key')
end
-- Check the per-page arguments before changing anything.
local arg = 6
for _ = 1, pages do
  local gained, lost = tonumber(ARGV[arg]), tonumber(ARGV[arg + 1])
  if not (integer(gained) and integer(lost)) or gained < 0 or lost < 0 then
    return redis.error_reply('ERR kvroute: page_apply page counts must be non-negative integers')
  end
  for j = arg + 2, arg + 1 + 2 * gained, 2 do
    local leaf, path = ARGV[j], ARGV[j + 1]
    if not (leaf and path) or #leaf ~= 16 or #path % 16 ~= 0 or #path == 0 or #path > 512
      or string.sub(path, -16) ~= leaf or string.find(path, '[^0-9a-f]') then
      return redis.error_reply('ERR kvroute: page_apply leaf ' .. tostring(leaf) .. ' needs a branch of 1-32 hex blocks ending at it')
    end
  end
  arg = arg + 2 + 2 * gained + lost
end
if arg - 1 ~= #ARGV then
  return redis.error_reply('ERR kvroute: page_apply arguments malformed: ' .. #ARGV .. ' given, ' .. (arg - 1) .. ' expected')
end

local state = redis.call('HMGET', state_key, 'op', 'n', 'dead')
local last_op, entries = tonumber(state[1] or '0'), tonumber(state[2] or '0')
local log_len = redis.call('STRLEN', log_key) / 8
if state[3] then
  return {'dead', 0, 0, 0, log_len, 0, 0}
end
if last_op >= op_id then
  return {'dup', 0, 0, 0, log_len, 0, entries}
end
if last_op ~= previous_op then
  return {'lost', 0, 0, 0, log_len, 0, entries}
end

local member = ',' .. gid .. ','
local function without(list, item)
  local at = string.find(list, ',' .. item .. ',', 1, true)
  if not at then
    return list, false
  end
  return string.sub(list, 1, at) .. string.sub(list, at + #item + 2), true
end

local gained_total, lost_total, missing, page_delta, appended = 0, 0, 0, 0, {}
arg = 6
for p = 1, pages do
  local key = KEYS[2 + p]
  local gained, lost = tonumber(ARGV[arg]), tonumber(ARGV[arg + 1])
  local mine = redis.call('HGET', key, 'g:' .. gid) or ','
  local had = mine ~= ','
  for j = arg + 2 + 2 * gained, arg + 1 + 2 * gained + lost do
    local leaf, found = ARGV[j], false
    mine, found = without(mine, leaf)
    if found then
      local holders = without(redis.call('HGET', key, 'e:' .. leaf) or ',', gid)
      if holders == ',' then
        redis.call('HDEL', key, 'e:' .. leaf, 't:' .. leaf)
      else
        redis.call('HSET', key, 'e:' .. leaf, holders)
      end
      lost_total = lost_total + 1
    else
      missing = missing + 1
    end
  end
  for j = arg + 2, arg + 1 + 2 * gained, 2 do
    local leaf = ARGV[j]
    if not string.find(mine, ',' .. leaf .. ',', 1, true) then
      mine = mine .. leaf .. ','
      local holders = redis.call('HGET', key, 'e:' .. leaf) or ','
      if not string.find(holders, member, 1, true) then
        holders = holders .. gid .. ','
      end
      redis.call('HSET', key, 'e:' .. leaf, holders, 't:' .. leaf, ARGV[j + 1])
      gained_total = gained_total + 1
    end
  end
  local has = mine ~= ','
  if has then
    redis.call('HSET', key, 'g:' .. gid, mine)
  elseif had then
    redis.call('HDEL', key, 'g:' .. gid)
  end
  if has ~= had then
    local holders = redis.call('HGET', key, 'h') or ','
    if has then
      if holders == ',' then
        page_delta = page_delta + 1
      end
      if not string.find(holders, member, 1, true) then
        redis.call('HSET', key, 'h', holders .. gid .. ',')
      end
      appended[#appended + 1] = string.sub(starts, 8 * p - 7, 8 * p)
    else
      holders = without(holders, gid)
      if holders == ',' then
        redis.call('HDEL', key, 'h')
        page_delta = page_delta - 1
      else
        redis.call('HSET', key, 'h', holders)
      end
    end
  end
  arg = arg + 2 + 2 * gained + lost
end

if #appended > 0 then
  log_len = redis.call('APPEND', log_key, table.concat(appended)) / 8
end
entries = entries + delta
redis.call('HSET', state_key, 'op', op_id, 'n', entries)
return {'ok', gained_total, lost_total, missing, log_len, page_delta, entries}
