#!lua flags=no-writes
-- page_match.lua: for a prompt's pages (32 blocks each, kept in segment keys: docs/index-schema.md,
-- "Pages, segments and buckets"), which gids hold each page whole along the prompt, and how deep
-- those that hold part of it go. The caller combines the pages in chain order (kvindex.pages.combine): a
-- gid's match is the pages it holds whole from the first on, plus its depth in the page where
-- it stops. Nothing is inferred from another gid's holdings.
--
-- A segment key is a HASH; for a page P (its first block's hex) in it: `h:<P>` the gids with a
-- holding in P; `e:<leaf>` the gids whose holding ends at that leaf block; `t:<leaf>` the branch
-- from P's first block to the leaf (16 hex digits a block); `g:<P>:<gid>` the gid's leaves in P.
-- Gid and leaf lists are `,item,item,`.
-- `c:<P>` the page's stem, `k:<block>` the gids holding a branch through the block after it
-- (page_apply.lua). Cost: one HMGET per segment key (each page's last block and holders); where
-- gids stop inside a page, its stem, and for those that go on past it along the prompt, their
-- leaves there and their branches.
--
-- KEYS[1..n] the segment keys of the pages read, in chain order, each once
-- ARGV[1] '1' when the pages are the prompt's first pages, consecutive: a gid that does not
--         hold a page whole then matters no further, and the walk ends at the first page that
--         nobody holds whole; '0' for pages read apart from the others (on a cluster)
-- ARGV[2] the pages' blocks in the prompt, 16 hex digits each, page after page (every page but
--         the prompt's last has 32 blocks)
-- ARGV[3..] per key: its number of pages n, then per page the fields `e:<its last block>` and
--         `h:<its first block>` (the client builds them: Lua's string work costs ~0.4 us a call)
-- Returns one {whole, {depth, ',gid,...,', ...}} per page read, in order: `whole` the gids that
-- hold the page whole along the prompt (',' for none), then the depths (0..length-1) of those
-- that stop inside it, and at most one negative depth: the depth of every other gid of its list
-- (see stops_in). Chained, a page's depths list only gids that held the previous page whole.
local chained, blocks = ARGV[1] == '1', ARGV[2]
local PAGE_HEX = 16 * 32

local function lists(list, item)
  return string.find(list, ',' .. item .. ',', 1, true) ~= nil
end

-- How many leading blocks `path` shares with `page` (both 16 hex digits a block).
local function common(path, page)
  if string.sub(page, 1, #path) == path then
    return #path / 16
  end
  local lo, hi = 0, math.min(#path, #page) / 16
  while lo < hi do
    local mid = math.ceil((lo + hi) / 2)
    if string.sub(path, 1, 16 * mid) == string.sub(page, 1, 16 * mid) then
      lo = mid
    else
      hi = mid - 1
    end
  end
  return lo
end

-- The depth in page P of a gid that holds part of it: its longest branch along the prompt.
local function depth_of(key, first, gid, page)
  local best = 0
  for leaf in string.gmatch(redis.call('HGET', key, 'g:' .. first .. ':' .. gid) or '', '(%x+),') do
    local path = redis.call('HGET', key, 't:' .. leaf)
    if path then
      best = math.max(best, common(path, page))
    end
  end
  return best
end

-- The gids of `holders` (P's) that do not hold it whole, and when chained held the one before:
-- {depth, gids, ...} for those that hold part of it along the prompt.
--
-- The page's stem (page_apply.lua): every branch in P starts with it. Where the prompt leaves it,
-- every holder stops there; where the prompt follows it, only the gids listed for the prompt's
-- block after it go on, and the others stop at its end. So with a stem the reply names those
-- others by the page's whole holder list, under a negative depth: {-depth, holders} says "every
-- gid of this list that holds the page neither whole nor at a depth listed here stops at depth"
-- (kvindex.pages.combine). A page that ends a shared system prompt then costs its fields and no
-- work per holder. Only the gids that go on past the stem have their leaves looked at. A page of
-- one holder has no stem, and a page without one (damaged) has every gid's leaves looked at.
local function stops_in(key, first, page, whole, holders, before)
  local _, commas = string.gsub(holders, ',', ',')
  local stem = commas > 2 and redis.call('HGET', key, 'c:' .. first)  -- two holders or more
  local by_depth, candidates, at = {}, holders, nil
  if stem then
    local s, k = #stem / 16, common(stem, page)
    if k < s or k >= #page / 16 then
      at, candidates = k, ','
    else
      at, candidates = s, redis.call('HGET', key, 'k:' .. string.sub(page, 16 * s + 1, 16 * s + 16)) or ','
    end
  end
  local among, other = candidates, before
  if before and #before < #candidates then
    among, other = before, candidates
  end
  for gid in string.gmatch(among, '(%d+),') do
    if not lists(whole, gid) and (other == nil or lists(other, gid)) then
      local d = depth_of(key, first, gid, page)
      if d > 0 or at then  -- (with a stem, 0 is said: it overrides the stem's depth)
        local listed = by_depth[d]
        if listed == nil then
          listed = {}
          by_depth[d] = listed
        end
        listed[#listed + 1] = gid
      end
    end
  end
  local stops = {}
  if at and at > 0 then
    stops[1], stops[2] = -at, holders
  end
  for d, gids in pairs(by_depth) do
    stops[#stops + 1] = d
    stops[#stops + 1] = ',' .. table.concat(gids, ',') .. ','
  end
  return stops
end

-- Check the shape first: every key's page count, the arguments, the blocks those pages span.
local pages, arg = 0, 3
for k = 1, #KEYS do
  local n = tonumber(ARGV[arg])
  if n == nil or n < 1 or n % 1 ~= 0 then
    return redis.error_reply('ERR kvroute: page_match key ' .. k .. ' has a bad page count')
  end
  pages, arg = pages + n, arg + 1 + 2 * n
end
if arg - 1 ~= #ARGV or #blocks % 16 ~= 0 or PAGE_HEX * (pages - 1) >= #blocks or PAGE_HEX * pages < #blocks then
  return redis.error_reply('ERR kvroute: page_match arguments malformed: the pages and the blocks do not agree')
end

local out, page_index, previous = {}, 0, nil
arg = 3
for k = 1, #KEYS do
  local key, n = KEYS[k], tonumber(ARGV[arg])
  local values = redis.call('HMGET', key, unpack(ARGV, arg + 1, arg + 2 * n))
  for j = 1, n do
    local whole, holders = values[2 * j - 1] or ',', values[2 * j] or ','
    local before = chained and previous or nil
    local stops = {}
    -- Nobody stops here when the page's holders are its whole holders (page_apply.lua keeps
    -- both lists in the same order when every holder holds the page whole), or (chained) when
    -- the holders of the previous page whole hold this one whole too. Else each candidate is
    -- looked at: a stranger listed by hand in one list moves nobody's match.
    if holders ~= whole and not (before and before == whole) then
      local page = string.sub(blocks, PAGE_HEX * page_index + 1, PAGE_HEX * (page_index + 1))
      stops = stops_in(key, string.sub(page, 1, 16), page, whole, holders, before)
    end
    out[#out + 1] = {whole, stops}
    if chained and whole == ',' then
      return out
    end
    previous = whole
    page_index = page_index + 1
  end
  arg = arg + 1 + 2 * n
end
return out
