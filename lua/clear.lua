-- clear.lua: drop all of a worker's blocks in O(1), or remove the worker altogether.
-- The worker's current gid is retired (its entries stop counting at once: match.lua only counts
-- alive gids) and gc (gc_bucket.lua) deletes the entries later in bounded steps.
-- mode 'keep': the worker stays registered under a fresh, empty gid (vLLM AllBlocksCleared,
--              an engine restart). Its heartbeat deadline carries over.
-- mode 'leave': the worker's record is deleted (graceful shutdown, or an operator's eviction).
--
-- KEYS[1] meta     HASH  model settings (unused; kept so that callers need not change)
-- KEYS[2] workers  HASH  worker_id -> current gid
-- KEYS[3] gids     HASH  gid -> worker_id
-- KEYS[4] alive    ZSET  gid -> heartbeat deadline (ms)
-- KEYS[5] retired  ZSET  gid -> retirement time (ms)
-- KEYS[6] record   HASH  the worker's record
-- KEYS[7] alive_version STRING  the version of `alive`'s membership (alive_since.lua)
-- ARGV[1] worker_id   ARGV[2] the caller's gid, or '' for whatever gid is current
-- ARGV[3] mode: 'keep' or 'leave'   ARGV[4] keep: the new gid the caller drew (see register.lua)
-- Returns {'ok', new gid (0 for leave)}, {'taken', 0} (draw another gid), {'missing', 0} or
-- {'superseded', 0}.
local meta_key, workers_key, gids_key = KEYS[1], KEYS[2], KEYS[3]
local alive_key, retired_key, record_key = KEYS[4], KEYS[5], KEYS[6]
local worker_id, expected_gid, mode, gid = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
-- A new version of who is alive (alive_since.lua): the server's clock in microseconds, or one
-- more than the last version if the clock stands still or went back, so a version is never
-- handed out twice, even after Redis lost the key.
local function bump_alive_version()
  local last = tonumber(redis.call('GET', KEYS[7]) or '0') or 0
  local now_us = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
  redis.call('SET', KEYS[7], string.format('%d', math.max(now_us, last + 1)))
end

if mode ~= 'keep' and mode ~= 'leave' then
  return redis.error_reply("ERR kvroute: clear mode must be 'keep' or 'leave', got " .. tostring(mode))
end
if mode == 'keep' and (gid == nil or not string.match(gid, '^[1-9]%d*$') or #gid > 16 or tonumber(gid) >= 2 ^ 53) then
  return redis.error_reply('ERR kvroute: gid must be a decimal integer in 1..2^53-1, got ' .. tostring(gid))
end
local old_gid = redis.call('HGET', workers_key, worker_id)
if not old_gid then
  return {'missing', 0}
end
if expected_gid ~= '' and expected_gid ~= old_gid then
  return {'superseded', 0}
end
if mode == 'keep' and (redis.call('HEXISTS', gids_key, gid) == 1 or redis.call('ZSCORE', alive_key, gid)
    or redis.call('ZSCORE', retired_key, gid)) then
  return {'taken', 0}
end
local deadline = redis.call('ZSCORE', alive_key, old_gid)
redis.call('ZREM', alive_key, old_gid)
redis.call('ZADD', retired_key, now_ms, old_gid)
bump_alive_version()

if mode == 'leave' then
  redis.call('HDEL', workers_key, worker_id)
  redis.call('DEL', record_key)
  return {'ok', 0}
end
redis.call('HSET', record_key, 'gid', gid, 'blocks', 0)
redis.call('HDEL', record_key, 'pending')  -- a re-assert's stage is void
redis.call('HSET', workers_key, worker_id, gid)
redis.call('HSET', gids_key, gid, worker_id)
redis.call('ZADD', alive_key, deadline or now_ms, gid)
return {'ok', gid}
