-- match.lua: for a prompt's chain of block hashes, the number of leading blocks every ALIVE
-- worker generation (gid) holds, in one round trip.
-- Every gid's entries are prefix-closed (apply.lua accepts a block only under an indexed parent;
-- removals and gc take children first), so along a chain the owner sets shrink monotonically:
-- owners(i) contains owners(i+1). Equal ZCARDs at two depths therefore mean equal owner sets in
-- between, and a bisection over depth finds the few depths where the set shrinks. Cost grows with
-- the number of distinct match lengths times log(chain length), not with the chain length.
-- Dead or retired gids may still own entries (until gc.lua runs) but are never reported.
--
-- KEYS[1] alive  ZSET  gid -> heartbeat deadline (ms, server clock)
-- ARGV[1] block key prefix (shares KEYS[1]'s hash tag)
-- ARGV[2] the chain: 8 bytes big-endian per block hash, block 0 first
-- Returns {alive gids as 'g1,g2,...', depth, 'gids owning block depth-1', depth, ...}, deepest
-- first. A gid's match is the first depth whose group lists it, 0 if none; only alive gids count.
local alive_key = KEYS[1]
local block_prefix, chain = ARGV[1], ARGV[2]
local n = #chain / 8
local HEX = '%02x%02x%02x%02x%02x%02x%02x%02x'
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local cards = {}
local boundaries = {}

if n % 1 ~= 0 then
  return redis.error_reply('ERR kvroute: match needs 8 bytes per block hash, got ' .. #chain .. ' bytes')
end
local alive = redis.call('ZRANGEBYSCORE', alive_key, '(' .. now_ms, '+inf')
if #alive == 0 then
  return {''}
end

local function block_key(i)
  return block_prefix .. string.format(HEX, string.byte(chain, 8 * i + 1, 8 * i + 8))
end
local function card(i)
  local c = cards[i]
  if c == nil then
    c = redis.call('ZCARD', block_key(i))
    cards[i] = c
  end
  return c
end

-- Boundaries: depths i where owners(i) loses members at i + 1 (depth n counts as empty).
if n > 0 and card(0) > 0 then
  if card(n - 1) > 0 then
    boundaries[#boundaries + 1] = n - 1
  end
  local stack = {}
  if card(0) > card(n - 1) then
    stack[1] = {0, n - 1}
  end
  while #stack > 0 do
    local span = table.remove(stack)
    local lo, hi = span[1], span[2]
    if hi == lo + 1 then
      boundaries[#boundaries + 1] = lo
    else
      local mid = math.floor((lo + hi) / 2)
      if card(lo) > card(mid) then
        stack[#stack + 1] = {lo, mid}
      end
      if card(mid) > card(hi) then
        stack[#stack + 1] = {mid, hi}
      end
    end
  end
end

-- Deepest boundary first: a gid's match length is one past the deepest block it owns; the client
-- gives each gid the depth of the first group it appears in. Members travel as comma-separated
-- strings and liveness is applied by the client: building per-member replies or a Lua set of the
-- alive gids would cost Redis more CPU than everything else in this script.
table.sort(boundaries, function(a, b) return a > b end)
local out = {table.concat(alive, ',')}
for _, b in ipairs(boundaries) do
  out[#out + 1] = b + 1
  out[#out + 1] = table.concat(redis.call('ZRANGE', block_key(b), 0, -1), ',')
end
return out
