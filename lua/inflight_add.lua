-- inflight_add.lua: add a router replica's load changes to its in-flight HASH (between the
-- snapshots lease.lua writes), in the same round trip as the replica's other writes.
-- A hash this creates gets the replica hashes' expiry (a replica killed before its next lease
-- must not leave it behind for good); an existing one keeps the expiry its lease gave it.
--
-- KEYS[1] inflight  HASH  this replica's load (fields '<r|t|u|a>:<worker id>')
-- ARGV[1] expire_ms (> 0)   ARGV[2..] field, delta pairs (integers)
-- Returns the number of fields changed.
local inflight_key, expire_ms = KEYS[1], tonumber(ARGV[1])
if expire_ms == nil or expire_ms <= 0 or (#ARGV - 1) % 2 ~= 0 then
  return redis.error_reply('ERR kvroute: inflight_add needs a positive expire_ms and field, delta pairs')
end
for i = 2, #ARGV, 2 do
  if not string.match(ARGV[i + 1], '^%-?%d+$') then
    return redis.error_reply('ERR kvroute: inflight_add deltas must be integers, got ' .. ARGV[i + 1])
  end
end
for i = 2, #ARGV, 2 do
  redis.call('HINCRBY', inflight_key, ARGV[i], ARGV[i + 1])
end
if redis.call('PTTL', inflight_key) == -1 then
  redis.call('PEXPIRE', inflight_key, expire_ms)
end
return (#ARGV - 1) / 2
