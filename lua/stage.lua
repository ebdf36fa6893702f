-- stage.lua: reserve a fresh gid for a worker's re-assert. The writer fills the staged gid with
-- its whole mirror while the current gid stays alive and matched, then swap.lua makes it current
-- in one step: readers never see the worker emptier than its old generation.
-- The staged gid is not alive, so no match counts it. It waits in `retired` with a score in the
-- future (now + stage_ttl_ms), where gc does not touch it until that time has passed: a
-- writer that dies before the swap leaves entries that gc collects then. A new stage replaces an
-- older one (which gc collects in its time), and register.lua / clear.lua discard it.
--
-- KEYS[1] gids     HASH  gid -> worker_id
-- KEYS[2] alive    ZSET  gid -> heartbeat deadline (ms)
-- KEYS[3] retired  ZSET  gid -> retirement time (ms); a staged gid: until when it is staged
-- KEYS[4] record   HASH  the worker's record (fields gid, pending)
-- ARGV[1] worker_id   ARGV[2] the caller's current gid   ARGV[3] the new gid (see register.lua)
-- ARGV[4] stage_ttl_ms (> 0)
-- Returns 'ok', 'taken' (draw another gid), 'missing' (no record) or 'superseded'.
local gids_key, alive_key, retired_key, record_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local worker_id, current_gid, gid, stage_ttl_ms = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

if gid == nil or not string.match(gid, '^[1-9]%d*$') or #gid > 16 or tonumber(gid) >= 2 ^ 53 then
  return redis.error_reply('ERR kvroute: gid must be a decimal integer in 1..2^53-1, got ' .. tostring(gid))
end
if stage_ttl_ms == nil or stage_ttl_ms <= 0 then
  return redis.error_reply('ERR kvroute: stage_ttl_ms must be a positive number, got ' .. tostring(ARGV[4]))
end
local current = redis.call('HGET', record_key, 'gid')
if not current then
  return 'missing'
end
if current ~= current_gid then
  return 'superseded'
end
if redis.call('HEXISTS', gids_key, gid) == 1 or redis.call('ZSCORE', alive_key, gid)
    or redis.call('ZSCORE', retired_key, gid) then
  return 'taken'
end
redis.call('HSET', record_key, 'pending', gid)
redis.call('HSET', gids_key, gid, worker_id)
redis.call('ZADD', retired_key, now_ms + stage_ttl_ms, gid)
return 'ok'
