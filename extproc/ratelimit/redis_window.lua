-- The sliding window of extproc/ratelimit/window.py, run atomically inside Redis (one round trip
-- per decision). One hash per scope key: field "t<bucket>" tokens, "r<bucket>" requests; every
-- write re-arms the key's expiry to one window + one bucket, so idle keys vanish by themselves.
--
-- KEYS: the scope keys of one decision (same hash tag, so one slot on a cluster).
-- ARGV[1] now_ms ("" = the server's TIME: every replica shares Redis's clock)
-- ARGV[2] bucket_ms, ARGV[3] buckets per window, ARGV[4] mode: "acquire" | "check" | "peek" | "settle"
--   (check: refuse or admit as acquire would, charging nothing; peek: read only)
-- acquire/check/peek: ARGV[5] cost (tokens), then per key ARGV[6 + 2(i-1)] token limit and
--               ARGV[7 + 2(i-1)] request limit (-1 = unlimited)
--   returns {admitted, refused index (1-based, 0 none), refused limit (0 none, 1 tokens,
--            2 requests), retry_after_ms, bucket, then per key: tokens, requests,
--            reset_tokens_ms, reset_requests_ms}
-- settle: ARGV[5] bucket charged, ARGV[6] delta tokens; returns the current bucket.
local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local bms = tonumber(ARGV[2])
local n = tonumber(ARGV[3])
local mode = ARGV[4]
local cur = math.floor(now / bms)
local oldest = cur - n + 1
local ttl = (n + 1) * bms

if mode == 'settle' then
  local bucket = tonumber(ARGV[5])
  local delta = tonumber(ARGV[6])
  for _, key in ipairs(KEYS) do
    if bucket > cur - n then
      local field = 't' .. bucket
      local v = tonumber(redis.call('HGET', key, field) or '0') + delta
      if v < 0 then v = 0 end
      redis.call('HSET', key, field, v)
      redis.call('PEXPIRE', key, ttl)
    elseif delta > 0 then
      redis.call('HINCRBY', key, 't' .. cur, delta)
      redis.call('PEXPIRE', key, ttl)
    end
  end
  return cur
end

local cost = tonumber(ARGV[5])
local states = {}
for i, key in ipairs(KEYS) do
  local flat = redis.call('HGETALL', key)
  local st = {t = {}, r = {}, ut = 0, ur = 0}
  local stale = {}
  for j = 1, #flat, 2 do
    local f = flat[j]
    local idx = tonumber(string.sub(f, 2))
    local v = tonumber(flat[j + 1])
    if idx < oldest then
      stale[#stale + 1] = f
    elseif string.sub(f, 1, 1) == 't' then
      st.t[idx] = v
      st.ut = st.ut + v
    else
      st.r[idx] = v
      st.ur = st.ur + v
    end
  end
  if #stale > 0 and mode == 'acquire' then
    redis.call('HDEL', key, unpack(stale))
  end
  states[i] = st
end

-- until the newest bucket with a non-zero count leaves the window
local function reset_ms(counts)
  local newest = nil
  for idx, v in pairs(counts) do
    if v > 0 and (newest == nil or idx > newest) then newest = idx end
  end
  if newest == nil then return 0 end
  return math.max(0, (newest + n) * bms - now)
end

-- until `need` has left the window, oldest bucket first
local function retry_ms(counts, need)
  local idxs = {}
  for idx, _ in pairs(counts) do idxs[#idxs + 1] = idx end
  table.sort(idxs)
  local freed = 0
  for _, idx in ipairs(idxs) do
    freed = freed + counts[idx]
    if freed >= need then return math.max(0, (idx + n) * bms - now) end
  end
  return n * bms
end

local function answer(admitted, refused, limit, retry)
  local out = {admitted, refused, limit, retry, cur}
  for _, st in ipairs(states) do
    out[#out + 1] = st.ut
    out[#out + 1] = st.ur
    out[#out + 1] = reset_ms(st.t)
    out[#out + 1] = reset_ms(st.r)
  end
  return out
end

if mode == 'peek' then return answer(1, 0, 0, 0) end

for i, st in ipairs(states) do
  local tlim = tonumber(ARGV[6 + 2 * (i - 1)])
  local rlim = tonumber(ARGV[7 + 2 * (i - 1)])
  if rlim >= 0 and st.ur + 1 > rlim then
    return answer(0, i, 2, retry_ms(st.r, st.ur + 1 - rlim))
  end
  if tlim >= 0 and st.ut + cost > tlim then
    return answer(0, i, 1, retry_ms(st.t, st.ut + cost - tlim))
  end
end

if mode == 'check' then return answer(1, 0, 0, 0) end

for i, key in ipairs(KEYS) do
  local st = states[i]
  redis.call('HINCRBY', key, 't' .. cur, cost)
  redis.call('HINCRBY', key, 'r' .. cur, 1)
  redis.call('PEXPIRE', key, ttl)
  st.t[cur] = (st.t[cur] or 0) + cost
  st.r[cur] = (st.r[cur] or 0) + 1
  st.ut = st.ut + cost
  st.ur = st.ur + 1
end
return answer(1, 0, 0, 0)
