-- adapters.lua: record which LoRA adapters a worker's engine serves now (adapters load and unload
-- at run time). Writes only into the current generation's record, like load.lua, so a late write
-- can never resurrect a deregistered or garbage-collected worker. register.lua writes the list a
-- registration starts with; this one its changes.
--
-- It also records the engine's KV-cache groups, which the agent learns from its first events
-- (kvindex/groups.py; absent: unchanged).
--
-- KEYS[1] record  HASH  the worker's record
-- ARGV[1] gid   ARGV[2] the adapters' names, one per line ('' for none; at most 65536 bytes)
-- ARGV[3] optional: the KV-cache groups, `index:kind:block_size:window` comma-separated (at most 4096 bytes)
-- Returns 'ok', 'missing' or 'superseded' (as heartbeat.lua).
local record_key = KEYS[1]
local gid, adapters, kv_groups = ARGV[1], ARGV[2], ARGV[3]
if adapters == nil or #adapters > 65536 then
  return redis.error_reply('ERR kvroute: adapters must be a list of at most 65536 bytes')
end
if kv_groups ~= nil and #kv_groups > 4096 then
  return redis.error_reply('ERR kvroute: the KV-cache groups must be at most 4096 bytes')
end
local current = redis.call('HGET', record_key, 'gid')
if not current then
  return 'missing'
end
if current ~= gid then
  return 'superseded'
end
redis.call('HSET', record_key, 'adapters', adapters)
if kv_groups ~= nil then
  redis.call('HSET', record_key, 'kv_groups', kv_groups)
end
return 'ok'
