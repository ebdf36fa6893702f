#!lua flags=no-writes
-- match.lua: for a prompt's chain of block hashes, the number of leading blocks every ALIVE
-- worker generation (gid) holds, in one round trip. Exact for every gid whatever state the block
-- keys are in: a gid is credited with depth d only if it is a member of every block key 0..d-1,
-- so entries that other gids got wrong, evicted or deleted keys, or members added by hand can
-- move no other gid's match. Nothing is inferred from set sizes or from a gid's other entries.
--
-- The walk: the candidates are the alive gids in block 0's set. Going down the chain 32 keys at
-- a time, one SINTER gives the gids that are in every key of the segment; candidates not among
-- them stopped inside it, and halving the segment with further SINTERs finds the depth where
-- each of them stopped. The walk ends when no candidate is left. SINTER runs in Redis's C code
-- over sets of integers (intsets): about one key lookup per block reached plus one membership
-- test per (candidate, block), and a few SINTERs more per distinct match length. This costs more
-- than inferring owners from set sizes (which any damaged key fools): see docs/benchmarks.md.
-- Keys are built for the blocks the walk reaches only.
--
-- KEYS[1] alive  ZSET  gid -> heartbeat deadline (ms, server clock)
-- ARGV[1] block key prefix (shares KEYS[1]'s hash tag; block keys are SETs of the gids that hold
--         the block)
-- ARGV[2] the chain: 16 lower-case hex digits per block hash (the key suffixes), block 0 first
-- Returns {alive gids as 'g1,g2,...', depth, 'gids whose match is depth', depth, ...}, deepest
-- first; an alive gid in no group matched 0 blocks.
local alive_key = KEYS[1]
local block_prefix, chain = ARGV[1], ARGV[2]
local n = #chain / 16
local SEGMENT = 32
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

if n % 1 ~= 0 or string.find(chain, '[^0-9a-f]') then
  return redis.error_reply('ERR kvroute: match needs 16 hex digits per block hash, got ' .. #chain .. ' characters')
end
local alive = redis.call('ZRANGEBYSCORE', alive_key, '(' .. now_ms, '+inf')
local out = {table.concat(alive, ',')}
if #alive == 0 or n == 0 then
  return out
end

local keys = {}  -- keys[d + 1] is block d's key, built up to the deepest segment reached
local function build_keys(through)
  for d = #keys, through do
    keys[d + 1] = block_prefix .. string.sub(chain, 16 * d + 1, 16 * d + 16)
  end
end

-- The gids of `set` that are in every key of depths lo..hi, and how many.
local function members_in(lo, hi, set)
  local found, count = {}, 0
  for _, gid in ipairs(redis.call('SINTER', unpack(keys, lo + 1, hi + 1))) do
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

build_keys(0)
local live = {}
for _, gid in ipairs(alive) do
  live[gid] = true
end
local candidates, count = {}, 0
for _, gid in ipairs(redis.call('SMEMBERS', keys[1])) do
  if live[gid] then
    candidates[gid] = true
    count = count + 1
  end
end
local lo = 1
while count > 0 and lo < n do
  local hi = math.min(lo + SEGMENT - 1, n - 1)
  build_keys(hi)
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
for _, group in ipairs(groups) do
  out[#out + 1] = group[1]
  out[#out + 1] = group[2]
end
return out
