#!lua flags=no-writes
-- inflight.lua: the in-flight load the live router replicas put on each worker, summed.
-- Read-only. The caller declares the hashes of the replicas it knows to be live (lease.lua's
-- reply); a replica whose lease has run out counts for nothing, even before its hash expires.
--
-- Bounded whatever the data: at most 64 replicas, and at most 16384 fields are read in all (up to 4
-- per worker per replica); a replica whose hash would go over what is left is skipped (say a
-- router that wrote garbage fields), so a call stays around a millisecond.
--
-- KEYS[1] replicas  ZSET  replica id -> lease deadline (ms)
-- KEYS[2..] the in-flight HASH of each replica named in ARGV, in order
-- ARGV[1..] replica ids
-- Returns a flat array field, total, field, total ... (fields '<r|t|u|a>:<worker id>').
local replicas_key = KEYS[1]
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local MAX_REPLICAS, MAX_FIELDS = 64, 16384
local totals, order = {}, {}
local fields_left = MAX_FIELDS

if #KEYS - 1 ~= #ARGV then
  return redis.error_reply('ERR kvroute: inflight needs one hash key per replica id, got ' .. (#KEYS - 1)
    .. ' keys for ' .. #ARGV .. ' ids')
end
for i = 1, math.min(#ARGV, MAX_REPLICAS) do
  local deadline = tonumber(redis.call('ZSCORE', replicas_key, ARGV[i]))
  local entries = {}
  if deadline ~= nil and deadline > now_ms then
    local size = redis.call('HLEN', KEYS[i + 1])
    if size <= fields_left then
      entries = redis.call('HGETALL', KEYS[i + 1])
      fields_left = fields_left - size
    end
  end
  for j = 1, #entries, 2 do
    local field, value = entries[j], tonumber(entries[j + 1]) or 0
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
