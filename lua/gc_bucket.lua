-- gc_bucket.lua: delete a retired gid's entries in one bucket, a chunk of its block log at a
-- time, newest first (children before parents, so the gid stays prefix-closed while collected).
-- The caller reads the chunk (GETRANGE) and declares its block keys; the script checks they are
-- the chunk's, at the state's cursor, so a stale or concurrent caller changes nothing. A cursor
-- beyond the log's end (the log was lost or replaced) counts from the end. When the log is done
-- the state becomes a tombstone (`dead`, expiring after dead_ttl_ms) that apply.lua refuses: a
-- writer that missed its retirement cannot leave entries that nothing would collect.
--
-- KEYS[1] state  HASH    the gid's state in this bucket (field c: log bytes still to collect)
-- KEYS[2] log    STRING  the gid's block log in this bucket
-- KEYS[3..] block keys of the log entries [cursor - 8k, cursor), in log order
-- ARGV[1] gid   ARGV[2] the cursor the caller read (bytes)   ARGV[3] dead_ttl_ms (> 0)
-- ARGV[4] block key prefix of the bucket (to check the declared keys)
-- Returns {'more'|'done'|'moved', entries removed, block keys emptied, cursor}; 'moved': the
-- cursor was not ARGV[2] (nothing done; read again).
local state_key, log_key = KEYS[1], KEYS[2]
local gid, expected, dead_ttl_ms, block_prefix = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local HEX = '%02x%02x%02x%02x%02x%02x%02x%02x'

if expected == nil or dead_ttl_ms == nil or dead_ttl_ms <= 0 then
  return redis.error_reply('ERR kvroute: gc_bucket needs a cursor and a positive dead_ttl_ms')
end
local log_bytes = redis.call('STRLEN', log_key)
local cursor = math.min(tonumber(redis.call('HGET', state_key, 'c')) or log_bytes, log_bytes)
cursor = cursor - cursor % 8
if redis.call('HEXISTS', state_key, 'dead') == 1 then
  return {'done', 0, 0, 0}
end
if cursor ~= expected then
  return {'moved', 0, 0, cursor}
end
local take = #KEYS - 2
if 8 * take > cursor then
  return redis.error_reply('ERR kvroute: gc_bucket got ' .. take .. ' keys for a cursor of ' .. cursor .. ' bytes')
end
local removed, gone = 0, 0
if take > 0 then
  local chunk = redis.call('GETRANGE', log_key, cursor - 8 * take, cursor - 1)
  for j = take - 1, 0, -1 do
    local key = KEYS[j + 3]
    if key ~= block_prefix .. string.format(HEX, string.byte(chunk, 8 * j + 1, 8 * j + 8)) then
      return redis.error_reply('ERR kvroute: gc_bucket key ' .. (j + 3) .. ' is not the log entry it stands for')
    end
    if redis.call('SREM', key, gid) == 1 then
      removed = removed + 1
      if redis.call('EXISTS', key) == 0 then
        gone = gone + 1
      end
    end
  end
end
cursor = cursor - 8 * take
if cursor > 0 then
  redis.call('HSET', state_key, 'c', cursor)
  return {'more', removed, gone, cursor}
end
redis.call('DEL', log_key, state_key)
redis.call('HSET', state_key, 'dead', 1)
redis.call('PEXPIRE', state_key, dead_ttl_ms)
return {'done', removed, gone, 0}
