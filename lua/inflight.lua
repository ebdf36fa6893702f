-- inflight.lua: the in-flight load all live router replicas put on each worker, summed.
-- Read-only. A replica whose lease has run out counts for nothing, even before lease.lua of
-- another replica deletes its hash.
--
-- KEYS[1] replicas  ZSET  replica id -> lease deadline (ms)
-- ARGV[1] in-flight key prefix (the per-replica HASH is prefix .. replica id)
-- Returns a flat array field, total, field, total ... (fields '<r|t|u>:<worker id>').
local replicas_key, inflight_prefix = KEYS[1], ARGV[1]
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local totals, order = {}, {}

for _, replica in ipairs(redis.call('ZRANGEBYSCORE', replicas_key, '(' .. now_ms, '+inf')) do
  local entries = redis.call('HGETALL', inflight_prefix .. replica)
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
