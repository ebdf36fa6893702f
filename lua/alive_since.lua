#!lua flags=no-writes
-- alive_since.lua: the model's alive gids for a reader that may already hold them. Every script
-- that changes who is alive (register, clear, swap, gc_retire, and a heartbeat that revives a
-- lapsed gid or lowers a deadline) writes a new version; a heartbeat that only pushes a live
-- deadline later does not. So a reader holding the gids and deadlines of version v is still
-- exact while the version is v and no deadline it holds has passed: the reply is then two
-- short values, whatever the fleet's size, instead of the whole set (kvindex.alive_cache).
--
-- KEYS[1] alive          ZSET    gid -> heartbeat deadline (ms, server clock)
-- KEYS[2] alive_version  STRING  the version of `alive`'s membership (absent: '')
-- ARGV[1] the version the reader holds ('' for none)
-- ARGV[2] refresh before (ms, server clock): the earliest deadline the reader holds, or sooner
-- ARGV[3] optional: a tag of the reader's (its own clock when it asked), echoed in the reply so
--         that it can tell which of its calls a reply answers
-- Returns {now_ms, version} while the reader's copy holds, else
-- {now_ms, version, 'gid,deadline,gid,deadline,...'} (the gids alive now, with their deadlines).
-- With a tag: {now_ms, version, tag, false} and {now_ms, version, tag, 'gid,deadline,...'}.
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local version = redis.call('GET', KEYS[2]) or ''
local held, refresh_before = ARGV[1] or '', tonumber(ARGV[2] or '')
if refresh_before == nil then
  return redis.error_reply('ERR kvroute: alive_since refresh time must be a number of ms, got ' .. tostring(ARGV[2]))
end
local tag = ARGV[3]
if held == version and now_ms < refresh_before then
  if tag then
    return {now_ms, version, tag, false}
  end
  return {now_ms, version}
end
local pairs_ = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now_ms, '+inf', 'WITHSCORES')
if tag then
  return {now_ms, version, tag, table.concat(pairs_, ',')}
end
return {now_ms, version, table.concat(pairs_, ',')}
