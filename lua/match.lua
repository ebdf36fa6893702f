#!lua flags=no-writes
-- match.lua: for a prompt's chain of blocks, the number of leading blocks each worker generation
-- (gid) holds, in one round trip. Exact for every gid whatever state the block keys are in: a
-- gid is credited with depth d only if it is a member of every block key 0..d-1, so entries
-- that other gids got wrong, evicted or deleted keys, or members added by hand can move no other
-- gid's match. Nothing is inferred from set sizes or from a gid's other entries.
-- Liveness is applied by the caller (alive.lua, read in the same round trip): the chain's keys
-- live in its bucket's slot, the liveness of the model in another (kvindex.keys).
--
-- The walk: the candidates are the gids in block 0's set. Going down the chain 32 keys at a
-- time, one SINTER gives the gids that are in every key of the segment; candidates not among
-- them stopped inside it, and halving the segment with further SINTERs finds the depth where
-- each of them stopped. The walk ends when no candidate is left. SINTER runs in Redis's C code
-- over sets of integers (intsets): about one key lookup per block reached plus one membership
-- test per (candidate, block), and a few SINTERs more per distinct match length.
--
-- KEYS[1..n] the chain's block keys (SETs of the gids that hold the block), block 0 first; all
--            in one bucket
-- Returns {depth, 'gids whose match is depth', depth, ...}, deepest first; a gid in no group
-- matched 0 blocks.
local n = #KEYS
local SEGMENT = 32
if n == 0 then
  return {}
end

-- The gids of `set` that are in every key of depths lo..hi, and how many.
local function members_in(lo, hi, set)
  local found, count = {}, 0
  for _, gid in ipairs(redis.call('SINTER', unpack(KEYS, lo + 1, hi + 1))) do
    if set[gid] then
      found[gid] = true
      count = count + 1
    end
  end
  return found, count
end

local groups = {}  -- {depth, 'gids'} for each match length found
local function add_group(depth, set)
  local gids = {}
  for gid in pairs(set) do
    gids[#gids + 1] = gid
  end
  groups[#groups + 1] = {depth, table.concat(gids, ',')}
end

-- The gids of `set` are in every key above lo and not in all of lo..hi: find where each stops.
local function place(set, lo, hi)
  if lo == hi then
    add_group(lo, set)
    return
  end
  local mid = math.floor((lo + hi) / 2)
  local through, through_count = members_in(lo, mid, set)
  local stopped, stopped_count = {}, 0
  for gid in pairs(set) do
    if not through[gid] then
      stopped[gid] = true
      stopped_count = stopped_count + 1
    end
  end
  if stopped_count > 0 then
    place(stopped, lo, mid)
  end
  if through_count > 0 then
    place(through, mid + 1, hi)
  end
end

local candidates, count = {}, 0
for _, gid in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  candidates[gid] = true
  count = count + 1
end
local lo = 1
while count > 0 and lo < n do
  local hi = math.min(lo + SEGMENT - 1, n - 1)
  local kept, kept_count = members_in(lo, hi, candidates)
  if kept_count < count then
    local stopped = {}
    for gid in pairs(candidates) do
      if not kept[gid] then
        stopped[gid] = true
      end
    end
    place(stopped, lo, hi)
  end
  candidates, count = kept, kept_count
  lo = hi + 1
end
if count > 0 then
  add_group(n, candidates)
end
table.sort(groups, function(a, b) return a[1] > b[1] end)
local out = {}
for _, group in ipairs(groups) do
  out[#out + 1] = group[1]
  out[#out + 1] = group[2]
end
return out
