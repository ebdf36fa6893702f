-- page_apply.lua: one worker generation's (gid's) changes to its holdings, in the segment keys
-- of one or more buckets, atomically (docs/index-schema.md, "Pages, segments and buckets"). A holding says
-- "the gid holds page P's blocks from its first through this leaf"; the writer's mirror works
-- out which leaves a gid gains and loses in each page, so a write costs per page, not per block.
-- On a single Redis a write sends all its buckets in one call; on a cluster one call a bucket.
--
-- A segment key is a HASH; for a page P (its first block's hex) in it: `h:<P>` the gids with a
-- holding in P; `e:<leaf>` the gids whose holding ends at that leaf; `t:<leaf>` the branch from
-- P's first block to the leaf (16 hex digits a block, the same for every holder: block hashes
-- are chained); `g:<P>:<gid>` the gid's leaves in P. Lists are `,item,item,`. A leaf nobody
-- holds loses its `e:` and `t:`, a page nobody holds its `h:`, and a segment key with no
-- fields left is gone (Redis drops an empty HASH).
-- The page's stem, once it has two holders or more: `c:<P>`, blocks that every branch in P starts
-- with (a gained branch can only shorten it); `k:<block>` for each block right after the stem,
-- the gids holding a branch through it; `K:<P>` the names of those blocks. page_match.lua reads them where holders stop
-- inside P: a gid not listed after the stem along the prompt stops at the stem's end, with no
-- look at its leaves (a shared system prompt that ends inside a page: every match stops there).
--
-- Continuity, per (gid, bucket), as apply.lua: the state's `op` is the id of the last call
-- applied there, and a call names the op id it follows. Not that one: 'lost' (the bucket lost
-- writes; the writer re-asserts). Applied already: 'dup', nothing changes. Collected: 'dead'.
-- Each bucket's part is judged and applied on its own.
--
-- KEYS, per bucket in ARGV's order: state (HASH: op, n = the gid's indexed blocks there; dead),
--   log (STRING: 32 hex digits per page the gid came to hold: its segment's, then its own
--   first block), then the bucket's segment keys, each once: KEYS[1..n]
-- ARGV[1] gid   ARGV[2] number of buckets
-- ARGV[3..] per bucket: previous op id, op id, change in the gid's indexed blocks there,
--   number of segment keys, number of pages; then per page: its segment key's place among the
--   bucket's segment keys (1..), its first block (16 hex digits), how many leaves the writer
--   knows the gid holds there before this call, leaves gained g, leaves lost l, g pairs (leaf,
--   branch), l leaves. A page holding another number of leaves (a segment key evicted or
--   deleted, a field lost) counts as missing: Redis lost the gid's data, and the writer
--   re-asserts the worker.
-- Returns per bucket {'ok'|'dup'|'lost'|'dead', leaves gained, leaves lost, lost leaves it did
-- not hold, log entries, pages created minus pages emptied, the gid's blocks in the bucket}.
local gid, buckets = ARGV[1], tonumber(ARGV[2])

local function integer(x)
  return x ~= nil and x % 1 == 0
end
local function hex16(x)
  return x ~= nil and #x == 16 and not string.find(x, '[^0-9a-f]')
end
local function fail(message)
  return redis.error_reply('ERR kvroute: page_apply ' .. message)
end
if not string.match(gid, '^%d+$') or not integer(buckets) or buckets < 1 then
  return fail('needs a decimal gid and a positive number of buckets')
end

-- Read and check every bucket's part before changing anything.
local parts, arg, key = {}, 3, 1
for b = 1, buckets do
  local part = {previous = tonumber(ARGV[arg]), op = tonumber(ARGV[arg + 1]), delta = tonumber(ARGV[arg + 2])}
  local keys, pages = tonumber(ARGV[arg + 3]), tonumber(ARGV[arg + 4])
  if not (integer(part.previous) and integer(part.op) and integer(part.delta) and integer(keys) and integer(pages))
    or part.op <= part.previous or keys < 1 or pages < 1 then
    return fail('bucket ' .. b .. ': op ids, block change and counts must be integers, op > previous op')
  end
  part.state, part.log, part.first_key, part.keys = key, key + 1, key + 2, keys
  key = key + 2 + keys
  arg = arg + 5
  part.pages = {}
  for _ = 1, pages do
    local at, first, held = tonumber(ARGV[arg]), ARGV[arg + 1], tonumber(ARGV[arg + 2])
    local gained, lost = tonumber(ARGV[arg + 3]), tonumber(ARGV[arg + 4])
    if not (integer(at) and at >= 1 and at <= keys and hex16(first) and integer(held) and integer(gained)
      and integer(lost)) or held < 0 or gained < 0 or lost < 0 then
      return fail('bucket ' .. b .. ': a page needs its key place, first block and counts')
    end
    arg = arg + 1
    for j = arg + 4, arg + 3 + 2 * gained, 2 do
      local leaf, path = ARGV[j], ARGV[j + 1]
      -- (The branch's inner blocks are not checked digit by digit: Lua's string work costs ~0.4 us
      -- a call, and a bad digit there could only shorten this leaf's own matches.)
      if not (hex16(leaf) and path) or #path % 16 ~= 0 or #path == 0 or #path > 512
        or string.sub(path, -16) ~= leaf or string.sub(path, 1, 16) ~= first then
        return fail('leaf ' .. tostring(leaf) .. ' needs a branch of 1-32 hex blocks from its page start to it')
      end
    end
    for j = arg + 4 + 2 * gained, arg + 3 + 2 * gained + lost do
      if not hex16(ARGV[j]) then
        return fail('lost leaves must be 16 hex digits')
      end
    end
    part.pages[#part.pages + 1] = {
      key = part.first_key + at - 1, first = first, held = held, arg = arg + 4, gained = gained, lost = lost,
    }
    arg = arg + 4 + 2 * gained + lost
  end
  parts[b] = part
end
if arg - 1 ~= #ARGV or key - 1 ~= #KEYS then
  return fail('arguments malformed: ' .. #ARGV .. ' arguments and ' .. #KEYS .. ' keys given, '
    .. (arg - 1) .. ' and ' .. (key - 1) .. ' expected')
end

local function without(list, item)
  local at = string.find(list, ',' .. item .. ',', 1, true)
  if not at then
    return list, false
  end
  return string.sub(list, 1, at) .. string.sub(list, at + #item + 2), true
end

-- How many leading blocks two branches (16 hex digits a block) share.
local function shared(a, b)
  local n = math.min(#a, #b)
  if string.sub(a, 1, n) == string.sub(b, 1, n) then
    return n / 16
  end
  local lo, hi = 0, n / 16
  while lo < hi do
    local mid = math.ceil((lo + hi) / 2)
    if string.sub(a, 1, 16 * mid) == string.sub(b, 1, 16 * mid) then
      lo = mid
    else
      hi = mid - 1
    end
  end
  return lo
end

-- The block of a branch at position s (0-based), or nil past its end.
local function block_at(branch, s)
  if #branch < 16 * (s + 1) then
    return nil
  end
  return string.sub(branch, 16 * s + 1, 16 * s + 16)
end

-- `gid` in or out of `k:<b>`, the registry `K:<P>` kept with it; returns the registry.
local function mark(key, b, gid, on, registry)
  local field = 'k:' .. b
  local listed = redis.call('HGET', key, field) or ','
  local has = string.find(listed, ',' .. gid .. ',', 1, true) ~= nil
  if on and not has then
    redis.call('HSET', key, field, listed .. gid .. ',')
    if listed == ',' then
      registry = registry .. b .. ','
    end
  elseif not on and has then
    listed = without(listed, gid)
    if listed == ',' then
      redis.call('HDEL', key, field)
      registry = without(registry, b)
    else
      redis.call('HSET', key, field, listed)
    end
  end
  return registry
end

-- Delete the `k:` lists a registry names, and the other fields given.
local function drop_lists(key, registry, ...)
  local gone = {...}
  for b in string.gmatch(registry, '(%x+),') do
    gone[#gone + 1] = 'k:' .. b
  end
  if #gone > 0 then
    redis.call('HDEL', key, unpack(gone))
  end
end

-- How many gids a list names.
local function count(list)
  local _, commas = string.gsub(list, ',', ',')
  return math.max(commas - 1, 0)
end

-- Page P's stem built afresh from every holder's branches: for a page that came to have two
-- holders (a page of one holder has none: page_match.lua looks at that gid's leaves), or a
-- damaged one.
local function build_stem(key, first, holders, stem_field, registry_field)
  local branches, stem = {}, nil
  for holder in string.gmatch(holders, '(%d+),') do
    for leaf in string.gmatch(redis.call('HGET', key, 'g:' .. first .. ':' .. holder) or '', '(%x+),') do
      local path = redis.call('HGET', key, 't:' .. leaf)
      if path then
        branches[#branches + 1] = {holder, path}
        stem = stem and string.sub(stem, 1, 16 * shared(stem, path)) or path
      end
    end
  end
  if stem == nil then
    return
  end
  local s, lists, registry = #stem / 16, {}, ','
  for _, branch in ipairs(branches) do
    local b = block_at(branch[2], s)
    if b then
      local listed = lists[b]
      if listed == nil then
        listed, registry = ',', registry .. b .. ','
      end
      if not string.find(listed, ',' .. branch[1] .. ',', 1, true) then
        lists[b] = listed .. branch[1] .. ','
      end
    end
  end
  local fields = {stem_field, stem}
  for b, listed in pairs(lists) do
    fields[#fields + 1] = 'k:' .. b
    fields[#fields + 1] = listed
  end
  if registry ~= ',' then
    fields[#fields + 1] = registry_field
    fields[#fields + 1] = registry
  end
  redis.call('HSET', key, unpack(fields))
end

-- Keep page P's stem (c:, k:, K:) true after `gid` gained the branches `gained` and lost the
-- branches `lost`, with `mine` its leaves now and `before` / `after` the page's holders. Only a
-- page of two holders or more has a stem (most pages have one: they cost nothing here).
local function keep_stem(key, first, gid, gained, lost, mine, before, after)
  local stem_field, registry_field = 'c:' .. first, 'K:' .. first
  local holders_before, holders_after = count(before), count(after)
  if holders_after < 2 and holders_before < 2 then
    return
  end
  local stem, registry = unpack(redis.call('HMGET', key, stem_field, registry_field))
  stem, registry = stem or nil, registry or ','  -- HMGET's nil is false in Lua
  if holders_after < 2 then  -- one holder or none: no stem
    drop_lists(key, registry, stem_field, registry_field)
    return
  end
  if holders_before < 2 or stem == nil then
    build_stem(key, first, after, stem_field, registry_field)
    return
  end
  local new_stem = stem
  for _, path in ipairs(gained) do
    new_stem = string.sub(new_stem, 1, 16 * shared(new_stem, path))
  end
  local s = #new_stem / 16
  local old_registry = registry
  if new_stem ~= stem then
    -- The blocks after the old stem lie deeper than the new one's end: their lists go. Every
    -- earlier branch went through the old stem's block at the new end.
    drop_lists(key, registry)
    registry = ','
    local b = stem and block_at(stem, s)
    if b and before ~= ',' then
      redis.call('HSET', key, 'k:' .. b, before)
      registry = ',' .. b .. ','
    end
  end
  local through = {}  -- blocks after the stem the gid now goes through by a gained branch
  for _, path in ipairs(gained) do
    local b = block_at(path, s)
    if b and not through[b] then
      through[b] = true
      registry = mark(key, b, gid, true, registry)
    end
  end
  local recheck, any = {}, false
  for _, path in ipairs(lost) do
    local b = block_at(path, s)
    if b and not through[b] then
      recheck[b], any = true, true
    end
  end
  if any then  -- still through that block by another branch?
    for leaf in string.gmatch(mine, '(%x+),') do
      local b = block_at(redis.call('HGET', key, 't:' .. leaf) or '', s)
      if b then
        recheck[b] = nil
      end
    end
    for b in pairs(recheck) do
      registry = mark(key, b, gid, false, registry)
    end
  end
  if new_stem ~= stem then
    redis.call('HSET', key, stem_field, new_stem)
  end
  if registry ~= old_registry then
    if registry == ',' then
      redis.call('HDEL', key, registry_field)
    else
      redis.call('HSET', key, registry_field, registry)
    end
  end
end

local function apply_page(page)
  local key, mine_field = KEYS[page.key], 'g:' .. page.first .. ':' .. gid
  local mine = redis.call('HGET', key, mine_field) or ','
  local had, gained, lost, missing, found = mine ~= ',', 0, 0, 0, false
  local gained_paths, lost_paths = {}, {}
  if #mine ~= 1 + 17 * page.held then  -- each leaf is 16 hex digits and a comma
    missing = missing + 1
  end
  for j = page.arg + 2 * page.gained, page.arg + 2 * page.gained + page.lost - 1 do
    local leaf = ARGV[j]
    mine, found = without(mine, leaf)
    if found then
      lost_paths[#lost_paths + 1] = redis.call('HGET', key, 't:' .. leaf) or ''
      local holders = without(redis.call('HGET', key, 'e:' .. leaf) or ',', gid)
      if holders == ',' then
        redis.call('HDEL', key, 'e:' .. leaf, 't:' .. leaf)
      else
        redis.call('HSET', key, 'e:' .. leaf, holders)
      end
      lost = lost + 1
    else
      missing = missing + 1
    end
  end
  local whole = false  -- gained a leaf at the page's end
  for j = page.arg, page.arg + 2 * page.gained - 1, 2 do
    local leaf = ARGV[j]
    if not string.find(mine, ',' .. leaf .. ',', 1, true) then
      mine = mine .. leaf .. ','
      local holders = without(redis.call('HGET', key, 'e:' .. leaf) or ',', gid)
      redis.call('HSET', key, 'e:' .. leaf, holders .. gid .. ',', 't:' .. leaf, ARGV[j + 1])
      gained_paths[#gained_paths + 1] = ARGV[j + 1]
      gained = gained + 1
      whole = whole or #ARGV[j + 1] == 16 * 32
    end
  end
  local has = mine ~= ','
  if has then
    redis.call('HSET', key, mine_field, mine)
  elseif had then
    redis.call('HDEL', key, mine_field)
  end
  local entry, pages = nil, 0
  local holders_field = 'h:' .. page.first
  local before = redis.call('HGET', key, holders_field) or ','
  local after = before
  -- A gid that comes to hold the page, or to hold it whole, goes to the end of `h:<P>`, as it
  -- goes to the end of `e:<leaf>`: while every holder holds the page whole, both lists are then
  -- the same string, and page_match.lua sees at once that nobody stops in the page.
  if has ~= had or (has and whole) then
    if has then
      pages = before == ',' and 1 or 0
      after = without(before, gid) .. gid .. ','
      redis.call('HSET', key, holders_field, after)
      if not had then
        entry = string.sub(key, -16) .. page.first
      end
    else
      after = without(before, gid)
      if after == ',' then
        redis.call('HDEL', key, holders_field)
        pages = -1
      else
        redis.call('HSET', key, holders_field, after)
      end
    end
  end
  if #gained_paths > 0 or #lost_paths > 0 then
    keep_stem(key, page.first, gid, gained_paths, lost_paths, mine, before, after)
  end
  return gained, lost, missing, entry, pages
end

local function apply_bucket(part)
  local state_key, log_key = KEYS[part.state], KEYS[part.log]
  local state = redis.call('HMGET', state_key, 'op', 'n', 'dead')
  local last_op, entries = tonumber(state[1] or '0'), tonumber(state[2] or '0')
  local log_len = redis.call('STRLEN', log_key) / 32
  if state[3] then
    return {'dead', 0, 0, 0, log_len, 0, 0}
  end
  if last_op >= part.op then
    return {'dup', 0, 0, 0, log_len, 0, entries}
  end
  if last_op ~= part.previous then
    return {'lost', 0, 0, 0, log_len, 0, entries}
  end
  local gained, lost, missing, pages, appended = 0, 0, 0, 0, {}
  for _, page in ipairs(part.pages) do
    local g, l, m, entry, p = apply_page(page)
    gained, lost, missing, pages = gained + g, lost + l, missing + m, pages + p
    appended[#appended + 1] = entry
  end
  if #appended > 0 then
    log_len = redis.call('APPEND', log_key, table.concat(appended)) / 32
  end
  entries = entries + part.delta
  redis.call('HSET', state_key, 'op', part.op, 'n', entries)
  return {'ok', gained, lost, missing, log_len, pages, entries}
end

local replies = {}
for b = 1, buckets do
  replies[b] = apply_bucket(parts[b])
end
return replies
