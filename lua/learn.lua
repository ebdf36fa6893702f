-- learn.lua: fold what one router replica learned since its last call into a model's shared cost
-- model (router/model_sync.py), and return the whole model, so that every replica routes by
-- what all of them observed. Each learned figure is an exponentially decayed sum, so a replica's
-- new observations fold in as a decayed batch: value = value * factor + delta. A field that is
-- missing (a new worker, a hash lost with its Redis) starts from `base`, the value the replica
-- last saw, so a lost model is re-seeded, not restarted. Idempotent: a replica resends a batch
-- whose reply it did not get with the same id, and the batch this replica applied last is not
-- applied again.
--
-- KEYS[1] learned     HASH  field -> value; '@<replica>' -> id of the last batch applied from it
-- KEYS[2] learned_at  ZSET  replica id -> ms of its last batch (server clock)
-- ARGV[1] replica id   ARGV[2] batch id   ARGV[3] forget_after_ms (> 0: a replica silent this
--   long loses its '@' field, at most 16 per call)   ARGV[4] expire_ms (> 0: the model's keys
--   expire this long after the last batch of any replica)
-- ARGV[5] n: fields to delete (a worker that left), ARGV[6 .. 5+n] those fields
-- ARGV[6+n ..] field, factor, delta, base quadruples (numbers)
-- Returns {applied (1, or 0 for a batch applied before), field, value, ...} (no '@' fields; no
--   fields at all from a hash of over 65,536: cost bounded, the replicas keep their own model).
local learned_key, learned_at_key = KEYS[1], KEYS[2]
local replica, batch = ARGV[1], ARGV[2]
local forget_after_ms, expire_ms, deletions = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])

if forget_after_ms == nil or forget_after_ms <= 0 or expire_ms == nil or expire_ms <= 0 then
  return redis.error_reply('ERR kvroute: learn forget_after_ms and expire_ms must be positive, got '
    .. tostring(ARGV[3]) .. ', ' .. tostring(ARGV[4]))
end
if deletions == nil or deletions < 0 or deletions ~= math.floor(deletions) or 5 + deletions > #ARGV then
  return redis.error_reply('ERR kvroute: learn needs a count of fields to delete, got ' .. tostring(ARGV[5]))
end
local first = 6 + deletions
if (#ARGV - first + 1) % 4 ~= 0 then
  return redis.error_reply('ERR kvroute: learn needs field, factor, delta, base quadruples')
end
for i = first, #ARGV, 4 do
  if string.sub(ARGV[i], 1, 1) == '@' or tonumber(ARGV[i + 1]) == nil or tonumber(ARGV[i + 2]) == nil
      or tonumber(ARGV[i + 3]) == nil then
    return redis.error_reply('ERR kvroute: learn quadruple ' .. tostring(ARGV[i]) .. ' is not a field and three numbers')
  end
end

local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local marker = '@' .. replica
local applied = 0
if redis.call('HGET', learned_key, marker) ~= batch then
  applied = 1
  for i = 6, 5 + deletions do
    if string.sub(ARGV[i], 1, 1) ~= '@' then
      redis.call('HDEL', learned_key, ARGV[i])
    end
  end
  for i = first, #ARGV, 4 do
    local old = tonumber(redis.call('HGET', learned_key, ARGV[i]) or ARGV[i + 3]) or tonumber(ARGV[i + 3])
    -- %.17g: a number as Lua would write it keeps only 14 digits
    redis.call('HSET', learned_key, ARGV[i], string.format('%.17g', old * tonumber(ARGV[i + 1]) + tonumber(ARGV[i + 2])))
  end
  redis.call('HSET', learned_key, marker, batch)
end
redis.call('ZADD', learned_at_key, now_ms, replica)
local silent = redis.call('ZRANGEBYSCORE', learned_at_key, '-inf', now_ms - forget_after_ms, 'LIMIT', 0, 16)
for _, gone in ipairs(silent) do
  redis.call('HDEL', learned_key, '@' .. gone)
  redis.call('ZREM', learned_at_key, gone)
end
redis.call('PEXPIRE', learned_key, expire_ms)
redis.call('PEXPIRE', learned_at_key, expire_ms)

local out = {applied}
if redis.call('HLEN', learned_key) > 65536 then
  return out  -- not a model kvroute wrote (it holds ~20 fields a worker): the replicas keep their own
end
local all = redis.call('HGETALL', learned_key)
for i = 1, #all, 2 do
  if string.sub(all[i], 1, 1) ~= '@' then
    out[#out + 1] = all[i]
    out[#out + 1] = all[i + 1]
  end
end
return out
