#!lua flags=no-writes
-- inflight.lua: the in-flight load all live router replicas put on each worker, summed.
-- Read-only. A replica whose lease has run out counts for nothing, even before lease.lua of
-- another replica deletes its hash.
--
-- Bounded whatever the data: the 64 most recently renewed replicas count, and at most 16384
-- fields are read in all (3 per worker per replica); a replica whose hash would go over what is
-- left is skipped (say a router that wrote garbage fields), so a call stays around a millisecond.
--
-- KEYS[1] replicas  ZSET  replica id -> lease deadline (ms)
-- ARGV[1] in-flight key prefix (the per-replica HASH is prefix .. replica id)
-- Returns a flat array field, total, field, total ... (fields '<r|t|u>:<worker id>').
local replicas_key, inflight_prefix = KEYS[1], ARGV[1]
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local MAX_REPLICAS, MAX_FIELDS = 64, 16384
local totals, order = {}, {}
local fields_left = MAX_FIELDS

for _, replica in ipairs(redis.call('ZREVRANGEBYSCORE', replicas_key, '+inf', '(' .. now_ms, 'LIMIT', 0, MAX_REPLICAS)) do
  local key = inflight_prefix .. replica
  local size = redis.call('HLEN', key)
  local entries = {}
  if size <= fields_left then
    entries = redis.call('HGETALL', key)
    fields_left = fields_left - size
  end
  for i = 1, #entries, 2 do
    local field, value = entries[i], tonumber(entries[i + 1]) or 0
    if totals[field] == nil then
      totals[field] = 0
      order[#order + 1] = field
    end
    totals[field] = totals[field] + value
  end
end
local out = {}
for _, field in ipairs(order) do
  out[#out + 1] = field
  out[#out + 1] = tostring(totals[field])
end
return out
