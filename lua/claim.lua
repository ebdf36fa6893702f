-- claim.lua: record the buckets a worker generation (gid) is about to write entries into, so
-- that gc finds them once the gid is retired. Only the worker's current gid, or the gid staged
-- for its re-assert, may claim: a writer whose registration is gone or was taken over learns it
-- here, before it writes into a bucket.
--
-- KEYS[1] record   HASH  the worker's record (fields gid, pending)
-- KEYS[2] buckets  SET   the buckets the gid has entries in
-- ARGV[1] gid   ARGV[2..] bucket numbers
-- Returns 'ok', 'missing' (no record: register again) or 'superseded'.
local record_key, buckets_key = KEYS[1], KEYS[2]
local gid = ARGV[1]
local record = redis.call('HMGET', record_key, 'gid', 'pending')
if not record[1] then
  return 'missing'
end
if record[1] ~= gid and record[2] ~= gid then
  return 'superseded'
end
for i = 2, #ARGV do
  if not string.match(ARGV[i], '^%d+$') then
    return redis.error_reply('ERR kvroute: claim buckets must be non-negative integers, got ' .. ARGV[i])
  end
end
if #ARGV > 1 then
  redis.call('SADD', buckets_key, unpack(ARGV, 2))
end
return 'ok'
