#!lua flags=no-writes
-- page_match.lua: for a prompt's pages (32 blocks each, docs/index-schema.md "The next layout"),
-- which gids hold each page whole along the prompt, and how deep the others that hold part of
-- it go. The caller combines the pages in chain order: a gid's match is the pages it holds
-- whole from the first on, plus its depth in the page where it stops (kvindex.pages).
--
-- A page key is a HASH: `h` the gids with a holding in the page; `e:<leaf>` the gids whose
-- holding ends at that leaf block; `t:<leaf>` the branch from the page's first block to the
-- leaf (16 hex digits a block); `g:<gid>` the gid's leaves. Gid lists are `,gid,gid,`.
-- Cost: one HGET per page, and where a gid stops inside a page, its leaves and their branches.
--
-- KEYS[1..n] the page keys, in the order of ARGV[2]
-- ARGV[1] the pages' blocks in the prompt, 16 hex digits each, page after page
-- ARGV[2] the pages' lengths in blocks, comma-separated (each 1..32)
-- ARGV[3] '1' when KEYS are the prompt's first pages, consecutive: a gid that does not hold a
--         page whole then matters no further, and the walk ends at the first page nobody
--         holds whole; '0' for pages read apart from the others (one bucket's on a cluster)
-- Returns one {whole, {depth, ',gid,...,', ...}} per page read: `whole` the gids holding the
-- page whole along the prompt (',' for none), then the depths (1..length-1) of the gids that
-- stop inside it. With ARGV[3] = '1' a page lists only gids that held the previous page whole.
local blocks, chained = ARGV[1], ARGV[3] == '1'
local lengths = {}
for n in string.gmatch(ARGV[2], '%d+') do
  lengths[#lengths + 1] = tonumber(n)
end
if #lengths ~= #KEYS then
  return redis.error_reply('ERR kvroute: page_match got ' .. #KEYS .. ' keys and ' .. #lengths .. ' page lengths')
end

local function lists(list, gid)
  return string.find(list, ',' .. gid .. ',', 1, true) ~= nil
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

-- The depth in this page of a gid that holds part of it: its best branch along the prompt.
local function depth_of(key, gid, page)
  local best = 0
  for leaf in string.gmatch(redis.call('HGET', key, 'g:' .. gid) or '', '(%x+),') do
    local path = redis.call('HGET', key, 't:' .. leaf)
    if path then
      best = math.max(best, common(path, page))
    end
  end
  return best
end

local out, offset, previous = {}, 0, nil
for i = 1, #KEYS do
  local key, length = KEYS[i], lengths[i]
  if length == nil or length < 1 or length > 32 or offset + 16 * length > #blocks then
    return redis.error_reply('ERR kvroute: page_match page ' .. i .. ' has a bad length or too few blocks')
  end
  local page = string.sub(blocks, offset + 1, offset + 16 * length)
  offset = offset + 16 * length
  local whole = redis.call('HGET', key, 'e:' .. string.sub(page, -16)) or ','
  local stops = {}
  -- Gids that may stop here: those with a holding in the page (`h`), and when chained only
  -- those that held the previous page whole. Nobody stops when they all hold it whole.
  if not (chained and previous == whole) then
    local holders = redis.call('HGET', key, 'h') or ','
    local before = chained and previous or nil  -- nil: no earlier page to filter by
    -- Walk the shorter of the two lists and check the other.
    local among, other = holders, before
    if before and #before < #holders then
      among, other = before, holders
    end
    if #holders > #whole then
      local by_depth = {}
      for gid in string.gmatch(among, '(%d+),') do
        if not lists(whole, gid) and (other == nil or lists(other, gid)) then
          local d = depth_of(key, gid, page)
          if d > 0 then
            by_depth[d] = (by_depth[d] or ',') .. gid .. ','
          end
        end
      end
      for d, gids in pairs(by_depth) do
        stops[#stops + 1] = d
        stops[#stops + 1] = gids
      end
    end
  end
  out[#out + 1] = {whole, stops}
  if chained and whole == ',' then
    break
  end
  previous = whole
end
return out
