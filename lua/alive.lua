#!lua flags=no-writes
-- alive.lua: members of a deadline ZSET (a model's `alive` or `retired`) by the Redis server's
-- clock, which is the clock every deadline was written with. Read with every match (match.lua
-- counts entries, this says whose count) and by gc (which gids are dead, which are due).
--
-- KEYS[1] ZSET  gid -> deadline or time (ms, server clock)
-- ARGV[1] mode: 'alive' (deadline in the future; the default), 'all' (every gid with its
--         score), 'due' (score now or earlier: retired gids gc may collect; staged ones wait
--         in the future), 'dead' (deadline at least ARGV[3] ms ago)
-- ARGV[2] 'due' and 'dead': at most this many gids   ARGV[3] 'dead': grace ms
-- Returns {now_ms, 'gid,gid,...'} for 'alive' (one string: a thousand gids parse in one split),
-- {now_ms, gid, ...} for 'due' and 'dead', {now_ms, gid, score, ...} for 'all'.
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local mode, limit, grace = ARGV[1] or 'alive', tonumber(ARGV[2] or '100'), tonumber(ARGV[3] or '0')
local out
if mode == 'alive' then
  out = {table.concat(redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now_ms, '+inf'), ',')}
elseif mode == 'all' then
  out = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
elseif (mode == 'due' or mode == 'dead') and limit and limit >= 0 and grace and grace >= 0 then
  local upto = mode == 'due' and now_ms or now_ms - grace
  out = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', upto, 'LIMIT', 0, limit)
else
  return redis.error_reply("ERR kvroute: alive mode must be alive, all, due or dead (with a limit and grace >= 0), got "
    .. tostring(mode))
end
table.insert(out, 1, now_ms)
return out
