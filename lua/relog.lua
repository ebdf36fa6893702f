-- relog.lua: replace a gid's block log with a compact one (no removed or repeated entries).
-- apply.lua only appends to the log, so churn (evict, store again) grows it; the writer, which
-- knows exactly which blocks the gid holds, rewrites it when it exceeds twice that. The new log
-- must list parents before children, so that gc.lua (which reads it backwards) removes children
-- first and the index stays prefix-closed while it is collected.
--
-- KEYS[1] record  HASH    the worker's record (fields gid, op)
-- KEYS[2] log     STRING  the gid's block log
-- ARGV[1] gid   ARGV[2] op id (integer > last op)   ARGV[3] the new log (8 bytes per block)
-- Returns {'ok'|'dup', log entries}.
local record_key, log_key = KEYS[1], KEYS[2]
local gid, op_id, new_log = ARGV[1], tonumber(ARGV[2]), ARGV[3]

if op_id == nil or op_id % 1 ~= 0 then
  return redis.error_reply('ERR kvroute: relog op id must be an integer, got ' .. tostring(ARGV[2]))
end
if #new_log % 8 ~= 0 then
  return redis.error_reply('ERR kvroute: relog needs 8 bytes per block, got ' .. #new_log .. ' bytes')
end
local current = redis.call('HGET', record_key, 'gid')
if current ~= gid then
  return redis.error_reply('ERR kvroute: stale generation: gid ' .. gid .. ' is not current (current: '
    .. tostring(current) .. ')')
end
if op_id <= tonumber(redis.call('HGET', record_key, 'op') or '0') then
  return {'dup', redis.call('STRLEN', log_key) / 8}
end
if #new_log == 0 then
  redis.call('DEL', log_key)
else
  redis.call('SET', log_key, new_log)
end
redis.call('HSET', record_key, 'op', op_id)
return {'ok', #new_log / 8}
