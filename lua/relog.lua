-- relog.lua: replace a gid's block log in one bucket with a compact one (no removed or repeated
-- entries). apply.lua only appends to the log, so churn (evict, store again) grows it; the
-- writer, which knows exactly which blocks the gid holds, rewrites it when it exceeds twice
-- that. The new log must list parents before children, so that gc_bucket.lua (which reads it
-- backwards) removes children first and the index stays prefix-closed while it is collected.
-- Ordered with the gid's apply.lua calls in the bucket by the same op ids (see apply.lua).
--
-- The page layout's logs (page_apply.lua: 32 hex digits per page held) are rewritten the same
-- way, with ARGV[5] = 32; their order does not matter to gc.
--
-- KEYS[1] state  HASH    the gid's state in this bucket (op, n; dead once collected)
-- KEYS[2] log    STRING  the gid's block log (or page log) in this bucket
-- ARGV[1] gid   ARGV[2] previous op id   ARGV[3] op id (> previous)   ARGV[4] the new log
-- ARGV[5] bytes per log entry: 8 (a block log, the default) or 32 (a page log)
-- Returns {'ok'|'dup'|'lost'|'dead', log entries}.
local state_key, log_key = KEYS[1], KEYS[2]
local previous_op, op_id, new_log = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local size = tonumber(ARGV[5] or '8')

if op_id == nil or op_id % 1 ~= 0 or previous_op == nil or op_id <= previous_op then
  return redis.error_reply('ERR kvroute: relog op ids must be integers, op > previous op, got '
    .. tostring(ARGV[3]) .. ' after ' .. tostring(ARGV[2]))
end
if size ~= 8 and size ~= 32 then
  return redis.error_reply('ERR kvroute: relog entries are 8 or 32 bytes, got ' .. tostring(ARGV[5]))
end
if new_log == nil or #new_log % size ~= 0 then
  return redis.error_reply('ERR kvroute: relog needs ' .. size .. ' bytes per entry, got ' .. #(new_log or '') .. ' bytes')
end
local state = redis.call('HMGET', state_key, 'op', 'dead')
local last_op = tonumber(state[1] or '0')
if state[2] then
  return {'dead', 0}
end
if last_op >= op_id then
  return {'dup', redis.call('STRLEN', log_key) / size}
end
if last_op ~= previous_op then
  return {'lost', redis.call('STRLEN', log_key) / size}
end
if #new_log == 0 then
  redis.call('DEL', log_key)
else
  redis.call('SET', log_key, new_log)
end
redis.call('HSET', state_key, 'op', op_id)
return {'ok', #new_log / size}
