-- register.lua: (re)register a worker under a fresh generation id (gid) that the caller drew.
-- A new registration means a new, empty view of the worker's cache: the previous gid (if any)
-- is retired, so its index entries stop counting at once and gc (gc_bucket.lua) deletes them later.
-- Gids are random (the client draws them uniformly from [2^32, 2^52)), never counted: a counter
-- in Redis is rewound by an empty restart, a FLUSHALL or a lossy failover, and would hand a gid
-- that routers have cached as one worker's to another. A gid this model still knows (in gids,
-- alive or retired) is refused with {'taken'}, and the caller draws again.
--
-- KEYS[1] meta     HASH  model settings: block_size, block_keys
-- KEYS[2] workers  HASH  worker_id -> current gid
-- KEYS[3] gids     HASH  gid -> worker_id (kept until the gid is garbage-collected)
-- KEYS[4] alive    ZSET  gid -> heartbeat deadline (ms, server clock)
-- KEYS[5] retired  ZSET  gid -> retirement time (ms); gc works through it oldest first
-- KEYS[6] record   HASH  the worker's record
-- KEYS[7] alive_version STRING  the version of `alive`'s membership (alive_since.lua)
-- ARGV[1] worker_id   ARGV[2] url   ARGV[3] model   ARGV[4] block_size (> 0)
-- ARGV[5] dp_rank (>= 0)   ARGV[6] ttl_ms (integer, 0..86400000)   ARGV[7] the new gid (decimal, 1 <= gid < 2^53)
-- ARGV[8] optional: the LoRA adapters the worker serves, one name per line ('' or absent: none;
--         at most 65536 bytes); adapters.lua records later changes
-- ARGV[9] optional: the cache tier this registration holds ('' or absent: the worker's GPU blocks;
--         'CPU', 'DISK', 'REMOTE': a tier holder, kvindex/tiers.py)   ARGV[10] optional: a tier
--         holder's worker id
-- ARGV[11] optional: the worker's role in a prefill/decode split: 'both' (or '' / absent),
--         'prefill' or 'decode' (kvindex/roles.py)
-- ARGV[12] optional: the engine's context length, max_model_len ('' / absent / 0: unknown)
-- ARGV[13] optional: the kind of engine, how its agent reads it: vllm, sglang, trtllm ('' / absent: not said)
-- Returns {'ok', gid, epoch} or {'taken', gid, 0}. Errors: "ERR kvroute: ..." for malformed arguments or a block size that
-- differs from the one the model's other alive workers use.
local meta_key, workers_key, gids_key = KEYS[1], KEYS[2], KEYS[3]
local alive_key, retired_key, record_key = KEYS[4], KEYS[5], KEYS[6]
local worker_id, url, model = ARGV[1], ARGV[2], ARGV[3]
local block_size, dp_rank, ttl_ms = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local gid = ARGV[7]
local adapters = ARGV[8] or ''
local tier, tier_of = ARGV[9] or '', ARGV[10] or ''
local role = ARGV[11] or ''
local max_model_len = ARGV[12] or ''
local engine_kind = ARGV[13] or ''
if max_model_len == '' then
  max_model_len = '0'
end
if role == '' then
  role = 'both'
end
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

if worker_id == nil or worker_id == '' then
  return redis.error_reply('ERR kvroute: register needs a non-empty worker id')
end
if block_size == nil or block_size < 1 or block_size % 1 ~= 0 then
  return redis.error_reply('ERR kvroute: block_size must be a positive integer, got ' .. tostring(ARGV[4]))
end
if dp_rank == nil or dp_rank < 0 or dp_rank % 1 ~= 0 then
  return redis.error_reply('ERR kvroute: dp_rank must be a non-negative integer, got ' .. tostring(ARGV[5]))
end
-- 'inf' and 'nan' parse as numbers in Lua: an infinite TTL would keep a dead worker alive forever.
if ttl_ms == nil or ttl_ms ~= ttl_ms or ttl_ms < 0 or ttl_ms > 86400000 or ttl_ms % 1 ~= 0 then
  return redis.error_reply('ERR kvroute: ttl_ms must be an integer from 0 to 86400000 (one day), got '
    .. tostring(ARGV[6]))
end
-- Canonical decimal only: scripts compare gids as strings, and Lua prints big numbers as 4.5e+15.
if gid == nil or not string.match(gid, '^[1-9]%d*$') or #gid > 16 or tonumber(gid) >= 2 ^ 53 then
  return redis.error_reply('ERR kvroute: gid must be a decimal integer in 1..2^53-1, got ' .. tostring(gid))
end
if not string.match(max_model_len, '^%d+$') or #max_model_len > 12 then
  return redis.error_reply('ERR kvroute: max_model_len must be a non-negative integer, got '
    .. string.sub(max_model_len, 1, 64))
end
if not string.match(engine_kind, '^[a-z0-9_]*$') or #engine_kind > 32 then
  return redis.error_reply('ERR kvroute: engine_kind must be a short lower-case name, got '
    .. string.sub(engine_kind, 1, 64))
end
if #adapters > 65536 then
  return redis.error_reply('ERR kvroute: adapters must be a list of at most 65536 bytes')
end
if (tier == '') ~= (tier_of == '') or #tier > 16 or #tier_of > 4096 then
  return redis.error_reply('ERR kvroute: a tier holder names its tier and its worker, got ' .. tier .. ', ' .. tier_of)
end
if role ~= 'both' and role ~= 'prefill' and role ~= 'decode' then
  return redis.error_reply('ERR kvroute: role must be both, prefill or decode, got ' .. string.sub(role, 1, 64))
end
if redis.call('HEXISTS', gids_key, gid) == 1 or redis.call('ZSCORE', alive_key, gid)
    or redis.call('ZSCORE', retired_key, gid) then
  return {'taken', gid, 0}
end

-- One block size per model: hashes of different block sizes never match, so a mismatch would
-- silently give zero overlap. Allow a change only when no other worker of the model is alive.
local model_block_size = tonumber(redis.call('HGET', meta_key, 'block_size'))
local old_gid = redis.call('HGET', workers_key, worker_id)
if model_block_size ~= nil and model_block_size ~= block_size then
  -- Two alive gids at most: one may be this worker's own previous generation.
  local alive = redis.call('ZRANGEBYSCORE', alive_key, '(' .. now_ms, '+inf', 'LIMIT', 0, 2)
  for _, other in ipairs(alive) do
    if other ~= old_gid then
      return redis.error_reply('ERR kvroute: block size mismatch: model ' .. model .. ' is served with block_size '
        .. model_block_size .. ' by alive worker ' .. tostring(redis.call('HGET', gids_key, other))
        .. ', worker ' .. worker_id .. ' announced ' .. block_size)
    end
  end
end
redis.call('HSET', meta_key, 'block_size', block_size)

if old_gid then
  redis.call('ZREM', alive_key, old_gid)
  redis.call('ZADD', retired_key, now_ms, old_gid)
end
local epoch = redis.call('HINCRBY', record_key, 'epoch', 1)
redis.call('HSET', record_key, 'id', worker_id, 'url', url, 'model', model, 'block_size', block_size,
  'dp_rank', dp_rank, 'gid', gid, 'registered_ms', now_ms, 'heartbeat_ms', now_ms, 'ttl_ms', ttl_ms,
  'blocks', 0, 'adapters', adapters, 'tier', tier, 'tier_of', tier_of, 'role', role,
  'max_model_len', max_model_len, 'engine_kind', engine_kind)
redis.call('HDEL', record_key, 'pending')  -- a re-assert's stage is void
redis.call('HSET', workers_key, worker_id, gid)
redis.call('HSET', gids_key, gid, worker_id)
redis.call('ZADD', alive_key, now_ms + ttl_ms, gid)
bump_alive_version()
return {'ok', gid, epoch}
