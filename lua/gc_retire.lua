-- gc_retire.lua: deregister workers whose heartbeat deadline passed more than grace_ms ago (the
-- first step of garbage collection). Their gid moves from `alive` to `retired` (gc_bucket.lua
-- then deletes its entries) and their record is deleted: an agent that comes back finds its
-- record 'missing' and registers again. The caller read the dead gids and their workers first
-- (their records must be declared in KEYS); each is checked again here, so a worker that
-- heartbeated in between stays.
--
-- KEYS[1] workers  HASH  worker_id -> current gid
-- KEYS[2] gids     HASH  gid -> worker_id
-- KEYS[3] alive    ZSET  gid -> heartbeat deadline (ms)
-- KEYS[4] retired  ZSET  gid -> retirement time (ms)
-- KEYS[5..] the record of each gid's worker, in ARGV's order
-- ARGV[1] grace_ms (>= 0)   ARGV[2..] the gids, one per record key
-- Returns the number of workers retired.
local workers_key, gids_key, alive_key, retired_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local grace_ms = tonumber(ARGV[1])
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

if grace_ms == nil or grace_ms < 0 then
  return redis.error_reply('ERR kvroute: gc grace_ms must be a non-negative number, got ' .. tostring(ARGV[1]))
end
if #KEYS - 4 ~= #ARGV - 1 then
  return redis.error_reply('ERR kvroute: gc_retire needs one record key per gid, got ' .. (#KEYS - 4)
    .. ' keys for ' .. (#ARGV - 1) .. ' gids')
end
local retired = 0
for i = 2, #ARGV do
  local gid = ARGV[i]
  local deadline = tonumber(redis.call('ZSCORE', alive_key, gid))
  if deadline ~= nil and deadline <= now_ms - grace_ms then
    local worker_id = redis.call('HGET', gids_key, gid)
    if worker_id and redis.call('HGET', workers_key, worker_id) == gid
        and redis.call('HGET', KEYS[i + 3], 'gid') == gid then
      redis.call('HDEL', workers_key, worker_id)
      redis.call('DEL', KEYS[i + 3])
    end
    redis.call('ZREM', alive_key, gid)
    redis.call('ZADD', retired_key, now_ms, gid)
    retired = retired + 1
  end
end
return retired
