-- gc.lua: delete the index entries of workers that are gone, in bounded steps.
-- 1. Workers whose heartbeat deadline passed more than grace_ms ago (up to min(budget, 1000) per
--    call) are deregistered: their gid is retired and their record deleted (an agent that comes
--    back finds its record 'missing' and registers again).
-- 2. Retired gids, oldest first, have their entries removed by reading their block log
--    backwards (children before parents, so every gid stays prefix-closed while collected).
--    A cursor per gid makes progress across calls. A call does at most `budget` units of work:
--    one per entry removed, and one for each gid finished with nothing left to remove (a
--    worker that registered and left without blocks), so one call never blocks Redis for long
--    however many gids wait. A cursor beyond the end of its log (the log was lost or replaced)
--    counts from the log's end. Entries of retired gids never count in match.lua, so collection
--    is only about memory.
--
-- KEYS[1] workers  HASH  worker_id -> current gid
-- KEYS[2] gids     HASH  gid -> worker_id
-- KEYS[3] alive    ZSET  gid -> heartbeat deadline (ms)
-- KEYS[4] retired  ZSET  gid -> retirement time (ms), or until when a gid is staged (stage.lua)
-- KEYS[5] cursors  HASH  gid -> log bytes still to collect
-- KEYS[6] meta     HASH  model settings (field block_keys counts distinct block keys)
-- ARGV[1] worker record key prefix   ARGV[2] block log key prefix   ARGV[3] block key prefix
-- ARGV[4] budget: most units of work in this call (> 0)   ARGV[5] grace_ms (>= 0)
-- Keys built from the prefixes share the model's hash tag, so they live in KEYS[1]'s slot.
-- Returns {workers retired, entries removed, gids finished, gids still pending}.
local workers_key, gids_key, alive_key = KEYS[1], KEYS[2], KEYS[3]
local retired_key, cursors_key, meta_key = KEYS[4], KEYS[5], KEYS[6]
local record_prefix, log_prefix, block_prefix = ARGV[1], ARGV[2], ARGV[3]
local budget, grace_ms = tonumber(ARGV[4]), tonumber(ARGV[5])
local HEX = '%02x%02x%02x%02x%02x%02x%02x%02x'
local MAX_DEAD_PER_CALL = 1000  -- retiring a worker is O(1); the budget bounds entry removal
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local retired_workers, removed, finished, gone_keys = 0, 0, 0, 0

if budget == nil or budget < 1 or budget % 1 ~= 0 then
  return redis.error_reply('ERR kvroute: gc budget must be a positive integer, got ' .. tostring(ARGV[4]))
end
if grace_ms == nil or grace_ms < 0 then
  return redis.error_reply('ERR kvroute: gc grace_ms must be a non-negative number, got ' .. tostring(ARGV[5]))
end

local dead = redis.call('ZRANGEBYSCORE', alive_key, '-inf', now_ms - grace_ms, 'LIMIT', 0,
  math.min(budget, MAX_DEAD_PER_CALL))
for _, gid in ipairs(dead) do
  local worker_id = redis.call('HGET', gids_key, gid)
  if worker_id and redis.call('HGET', workers_key, worker_id) == gid then
    redis.call('HDEL', workers_key, worker_id)
    redis.call('DEL', record_prefix .. worker_id)
  end
  redis.call('ZREM', alive_key, gid)
  redis.call('ZADD', retired_key, now_ms, gid)
  retired_workers = retired_workers + 1
end

while budget > 0 do
  -- Gids staged for a re-assert (stage.lua) wait here with a score in the future: not yet.
  local oldest = redis.call('ZRANGEBYSCORE', retired_key, '-inf', now_ms, 'LIMIT', 0, 1)
  if #oldest == 0 then
    break
  end
  local gid = oldest[1]
  local log_key = log_prefix .. gid
  local log_bytes = redis.call('STRLEN', log_key)
  local remaining = math.min(tonumber(redis.call('HGET', cursors_key, gid)) or log_bytes, log_bytes)
  remaining = remaining - remaining % 8
  local take = math.min(budget, remaining / 8)
  if take > 0 then
    local chunk = redis.call('GETRANGE', log_key, remaining - 8 * take, remaining - 1)
    for j = take - 1, 0, -1 do
      local key = block_prefix .. string.format(HEX, string.byte(chunk, 8 * j + 1, 8 * j + 8))
      if redis.call('SREM', key, gid) == 1 then
        removed = removed + 1
        if redis.call('EXISTS', key) == 0 then
          gone_keys = gone_keys + 1
        end
      end
    end
    remaining = remaining - 8 * take
    budget = budget - take
  else
    budget = budget - 1  -- nothing to remove: finishing the gid is the unit of work
  end
  if remaining == 0 then
    redis.call('DEL', log_key)
    redis.call('HDEL', cursors_key, gid)
    redis.call('HDEL', gids_key, gid)
    redis.call('ZREM', retired_key, gid)
    finished = finished + 1
  else
    redis.call('HSET', cursors_key, gid, remaining)
  end
end

if gone_keys > 0 then
  redis.call('HINCRBY', meta_key, 'block_keys', -gone_keys)
end
return {retired_workers, removed, finished, redis.call('ZCARD', retired_key)}
