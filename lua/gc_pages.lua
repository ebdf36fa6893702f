-- gc_pages.lua: delete a retired gid's holdings in one bucket of the page layout
-- (docs/index-schema.md, "Pages, segments and buckets"), a chunk of its page log at a time, newest first.
-- The caller reads the chunk (GETRANGE) and declares each entry's segment key; the script checks
-- they are the chunk's, at the state's cursor, so a stale or concurrent caller changes nothing. A
-- cursor beyond the log's end (the log was lost or replaced) counts from the end. When the log is
-- done the state becomes a tombstone (`dead`, expiring after dead_ttl_ms) that page_apply.lua
-- refuses. A log entry whose page no longer lists the gid (it let go, or was collected) costs a
-- lookup and nothing more. A retired gid counts in no match, so the order does not matter. The
-- gid also leaves the list of the block after its page's stem (`k:`), and a page left with one
-- holder or none loses its stem (`c:`, `K:`, `k:`: see page_apply.lua).
--
-- KEYS[1] state  HASH    the gid's state in this bucket (field c: log bytes still to collect)
-- KEYS[2] log    STRING  the gid's page log in this bucket (32 hex digits an entry: the page's
--                        segment's first block, then its own)
-- KEYS[3..] the segment key of each log entry in [cursor - 32k, cursor), in log order
-- ARGV[1] gid   ARGV[2] the cursor the caller read (bytes)   ARGV[3] dead_ttl_ms (> 0)
-- ARGV[4] segment key prefix of the bucket (to check the declared keys)
-- Returns {'more'|'done'|'moved', holdings removed, pages emptied, cursor}; 'moved': the
-- cursor was not ARGV[2] (nothing done; read again).
local state_key, log_key = KEYS[1], KEYS[2]
local gid, expected, dead_ttl_ms, segment_prefix = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local ENTRY = 32

if expected == nil or dead_ttl_ms == nil or dead_ttl_ms <= 0 or not string.match(gid or '', '^%d+$') then
  return redis.error_reply('ERR kvroute: gc_pages needs a decimal gid, a cursor and a positive dead_ttl_ms')
end
local log_bytes = redis.call('STRLEN', log_key)
local cursor = math.min(tonumber(redis.call('HGET', state_key, 'c')) or log_bytes, log_bytes)
cursor = cursor - cursor % ENTRY
if redis.call('HEXISTS', state_key, 'dead') == 1 then
  return {'done', 0, 0, 0}
end
if cursor ~= expected then
  return {'moved', 0, 0, cursor}
end
local take = #KEYS - 2
if ENTRY * take > cursor then
  return redis.error_reply('ERR kvroute: gc_pages got ' .. take .. ' keys for a cursor of ' .. cursor .. ' bytes')
end

local function without(list, item)
  local at = string.find(list, ',' .. item .. ',', 1, true)
  if not at then
    return list
  end
  return string.sub(list, 1, at) .. string.sub(list, at + #item + 2)
end

local removed, emptied = 0, 0
if take > 0 then
  local chunk = redis.call('GETRANGE', log_key, cursor - ENTRY * take, cursor - 1)
  for j = take - 1, 0, -1 do
    local key = KEYS[j + 3]
    local segment, page = string.sub(chunk, ENTRY * j + 1, ENTRY * j + 16), string.sub(chunk, ENTRY * j + 17, ENTRY * j + 32)
    if key ~= segment_prefix .. segment then
      return redis.error_reply('ERR kvroute: gc_pages key ' .. (j + 3) .. ' is not the log entry it stands for')
    end
    local mine_field = 'g:' .. page .. ':' .. gid
    local mine = redis.call('HGET', key, mine_field)
    if mine then
      local stem, registry = unpack(redis.call('HMGET', key, 'c:' .. page, 'K:' .. page))
      stem = stem or nil  -- HMGET's nil is false in Lua
      local s = stem and #stem / 16
      registry = registry or ','
      for leaf in string.gmatch(mine, '(%x+),') do
        local branch = redis.call('HGET', key, 't:' .. leaf) or ''
        if s and #branch >= 16 * (s + 1) then  -- out of the list of the block after the stem
          local b = string.sub(branch, 16 * s + 1, 16 * s + 16)
          local listed = without(redis.call('HGET', key, 'k:' .. b) or ',', gid)
          if listed == ',' then
            redis.call('HDEL', key, 'k:' .. b)
            registry = without(registry, b)
          else
            redis.call('HSET', key, 'k:' .. b, listed)
          end
        end
        local holders = without(redis.call('HGET', key, 'e:' .. leaf) or ',', gid)
        if holders == ',' then
          redis.call('HDEL', key, 'e:' .. leaf, 't:' .. leaf)
        else
          redis.call('HSET', key, 'e:' .. leaf, holders)
        end
        removed = removed + 1
      end
      redis.call('HDEL', key, mine_field)
      local holders_field = 'h:' .. page
      local holders = without(redis.call('HGET', key, holders_field) or ',', gid)
      local _, commas = string.gsub(holders, ',', ',')
      if commas <= 2 then  -- one holder or none: the page has no stem (page_apply.lua)
        local gone = {'c:' .. page, 'K:' .. page}
        for b in string.gmatch(registry, '(%x+),') do
          gone[#gone + 1] = 'k:' .. b
        end
        redis.call('HDEL', key, unpack(gone))
      elseif registry == ',' then
        redis.call('HDEL', key, 'K:' .. page)
      elseif stem then
        redis.call('HSET', key, 'K:' .. page, registry)
      end
      if holders == ',' then
        if redis.call('HDEL', key, holders_field) == 1 then
          emptied = emptied + 1
        end
      else
        redis.call('HSET', key, holders_field, holders)
      end
    end
  end
end
cursor = cursor - ENTRY * take
if cursor > 0 then
  redis.call('HSET', state_key, 'c', cursor)
  return {'more', removed, emptied, cursor}
end
redis.call('DEL', log_key, state_key)
redis.call('HSET', state_key, 'dead', 1)
redis.call('PEXPIRE', state_key, dead_ttl_ms)
return {'done', removed, emptied, 0}
