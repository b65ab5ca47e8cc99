-- The sliding window, concurrency cap and pacing bucket of extproc/ratelimit/window.py, run
-- atomically inside Redis (one round trip per decision). One hash per scope key:
--   "t<bucket>" tokens, "r<bucket>" requests (the window);
--   "i<request id>" the time an in-flight request was admitted (ms), "h" mean hold time (ms);
--   "l" pacing level (1/60,000 tokens), "lm" when it was computed (ms), "lr" its refill rate
--   (tokens per minute), "lb" its burst (tokens);
--   "x<request id>" when an acquire the client gave up on was aborted before it ran (ms): that
--   acquire, when it runs late (Redis stalled with it queued), is refused. Pruned after the lease.
-- Every write re-arms the key's expiry to the longest of: one window + one bucket, the in-flight
-- lease (while requests are in flight), the time the bucket needs to refill, so idle keys vanish
-- by themselves and a key never vanishes while it still holds something.
--
-- KEYS: the scope keys of one decision (same hash tag, so one slot on a cluster).
-- ARGV[1] now_ms ("" = the server's TIME: every replica shares Redis's clock)
-- ARGV[2] bucket_ms, ARGV[3] buckets per window, ARGV[4] mode: "acquire" | "check" | "peek" | "settle"
--   | "abort" (check: refuse or admit as acquire would, charging nothing; peek: read only)
-- acquire/check/peek: ARGV[5] cost (tokens), ARGV[6] request id ("" none), ARGV[7] lease_ms,
--   then per key ARGV[8 + 4(i-1)] .. ARGV[11 + 4(i-1)]: token limit, request limit, concurrency
--   cap, burst (-1 = none)
--   returns {admitted, refused index (1-based, 0 none), refused limit (0 none, 1 tokens,
--            2 requests, 3 concurrency, 4 pacing), retry_after_ms, bucket, then per key: tokens,
--            requests, reset_tokens_ms, reset_requests_ms, inflight, bucket level (false: not paced)}
-- settle: ARGV[5] bucket charged, ARGV[6] delta tokens, ARGV[7] request id ("" none), ARGV[8]
--   lease_ms; returns the current bucket.
-- abort: the client timed out waiting for an acquire with this request id, which may run later or
--   may have run already (its reply lost): ARGV[5] its cost (tokens), ARGV[6] request id, ARGV[7]
--   lease_ms. Ran already: settle it with -cost (tokens back in the bucket it charged, slot
--   released). Not yet: leave "x<request id>" in every key, so it is refused when it runs.
--   Running twice is harmless (the second finds no slot and leaves a tombstone nobody reads).
--   Returns the current bucket.
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
local SCALE = 60000
local DEFAULT_HOLD = 1000

local function num(v)
  return string.format('%.0f', v)
end

-- the level at `now` (refilled from lm at lr per ms, at most lb tokens)
local function refill(level, lm, rate, burst)
  local cap = burst * SCALE
  local dt = math.max(0, now - lm)
  if dt * rate >= cap - level then return cap end
  return level + dt * rate
end

-- re-arm the expiry: the window, the in-flight lease, the bucket's refill
local function rearm(key, lease, inflight, level, rate, burst)
  local ttl = (n + 1) * bms
  if inflight > 0 and lease > ttl then ttl = lease end
  if level ~= nil and rate > 0 then
    local fill = math.ceil((burst * SCALE - level) / rate) + bms
    if fill > ttl then ttl = fill end
  end
  redis.call('PEXPIRE', key, ttl)
end

local settling = nil  -- {bucket, delta, request id, lease_ms} of a settle (or of an abort that ran)
if mode == 'abort' then
  local rid = ARGV[6]
  local lease = tonumber(ARGV[7])
  local admitted = nil
  for _, key in ipairs(KEYS) do
    admitted = redis.call('HGET', key, 'i' .. rid)
    if admitted then break end
  end
  if not admitted then
    for _, key in ipairs(KEYS) do
      redis.call('HSET', key, 'x' .. rid, num(now))
      if redis.call('PTTL', key) < lease then redis.call('PEXPIRE', key, lease) end
    end
    return cur
  end
  -- settle it: the tokens go back to the bucket it charged, the slot is released
  settling = {math.floor(tonumber(admitted) / bms), -tonumber(ARGV[5]), rid, lease}
elseif mode == 'settle' then
  settling = {tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7], tonumber(ARGV[8])}
end

if settling ~= nil then
  local bucket, delta, rid, lease = settling[1], settling[2], settling[3], settling[4]
  for _, key in ipairs(KEYS) do
    local touched = false
    local level, rate, burst = nil, 0, 0
    if delta ~= 0 then
      if bucket > cur - n then
        local field = 't' .. bucket
        local v = tonumber(redis.call('HGET', key, field) or '0') + delta
        if v < 0 then v = 0 end
        redis.call('HSET', key, field, v)
        touched = true
      elseif delta > 0 then
        redis.call('HINCRBY', key, 't' .. cur, delta)
        touched = true
      end
      local p = redis.call('HMGET', key, 'l', 'lm', 'lr', 'lb')
      if p[1] then
        rate, burst = tonumber(p[3]), tonumber(p[4])
        level = refill(tonumber(p[1]), tonumber(p[2]), rate, burst) - delta * SCALE
        if level > burst * SCALE then level = burst * SCALE end
        redis.call('HSET', key, 'l', num(level), 'lm', num(now))
        touched = true
      end
    end
    if rid ~= '' then
      local admitted = redis.call('HGET', key, 'i' .. rid)
      if admitted then
        redis.call('HDEL', key, 'i' .. rid)
        local hold = tonumber(redis.call('HGET', key, 'h') or DEFAULT_HOLD)
        hold = hold + math.floor((math.max(0, now - tonumber(admitted)) - hold) / 8)
        redis.call('HSET', key, 'h', num(hold))
        touched = true
      end
    end
    if touched then
      if level == nil then
        local p = redis.call('HMGET', key, 'l', 'lr', 'lb')
        if p[1] then level, rate, burst = tonumber(p[1]), tonumber(p[2]), tonumber(p[3]) end
      end
      local inflight = 0
      for _, f in ipairs(redis.call('HKEYS', key)) do
        if string.sub(f, 1, 1) == 'i' then inflight = inflight + 1 end
      end
      rearm(key, lease, inflight, level, rate, burst)
    end
  end
  return cur
end

local cost = tonumber(ARGV[5])
local rid = ARGV[6]
local lease = tonumber(ARGV[7])
local states = {}
local aborted = false
for i, key in ipairs(KEYS) do
  local tlim = tonumber(ARGV[8 + 4 * (i - 1)])
  local rlim = tonumber(ARGV[9 + 4 * (i - 1)])
  local clim = tonumber(ARGV[10 + 4 * (i - 1)])
  local blim = tonumber(ARGV[11 + 4 * (i - 1)])
  local flat = redis.call('HGETALL', key)
  local st = {t = {}, r = {}, ut = 0, ur = 0, inflight = 0, hold = DEFAULT_HOLD,
              tlim = tlim, rlim = rlim, clim = clim, blim = blim, paced = blim >= 0 and tlim > 0}
  local stale = {}
  local named = {}
  for j = 1, #flat, 2 do
    local f = flat[j]
    local kind = string.sub(f, 1, 1)
    local v = tonumber(flat[j + 1])
    if kind == 't' or kind == 'r' then
      local idx = tonumber(string.sub(f, 2))
      if idx < oldest then
        stale[#stale + 1] = f
      elseif kind == 't' then
        st.t[idx] = v
        st.ut = st.ut + v
      else
        st.r[idx] = v
        st.ur = st.ur + v
      end
    elseif kind == 'i' then
      if v + lease <= now then
        stale[#stale + 1] = f
      else
        st.inflight = st.inflight + 1
        if st.first == nil or v < st.first then st.first = v end
      end
    elseif kind == 'x' then
      if v + lease <= now then
        stale[#stale + 1] = f
      elseif rid ~= '' and f == 'x' .. rid then
        aborted = true
      end
    else
      named[f] = v
    end
  end
  if named['h'] then st.hold = named['h'] end
  if st.paced then
    if named['l'] then
      st.level = refill(named['l'], named['lm'], named['lr'], named['lb'])
      if st.level > blim * SCALE then st.level = blim * SCALE end
    else
      st.level = blim * SCALE
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
    if st.clim >= 0 then out[#out + 1] = st.inflight else out[#out + 1] = 0 end
    if st.paced then out[#out + 1] = math.floor(st.level / SCALE) else out[#out + 1] = false end
  end
  return out
end

if mode == 'peek' then return answer(1, 0, 0, 0) end
if aborted and mode == 'acquire' then
  -- the client gave up on this acquire before it ran: charge nothing, hold no slot
  for _, key in ipairs(KEYS) do redis.call('HDEL', key, 'x' .. rid) end
  return answer(0, 1, 3, 1)
end

-- window.py's _concurrency_retry_ms: the mean hold / in flight, no less than what the oldest
-- still needs at the mean hold, no more than its lease's remaining time
local function concurrency_retry(st)
  local est = math.ceil(st.hold / math.max(1, st.inflight))
  if st.first ~= nil then
    est = math.max(est, st.hold - (now - st.first))
    est = math.min(est, st.first + lease - now)
  end
  return math.max(1, est)
end

for i, st in ipairs(states) do
  if st.clim >= 0 and st.inflight + 1 > st.clim then
    return answer(0, i, 3, concurrency_retry(st))
  end
  if st.rlim >= 0 and st.ur + 1 > st.rlim then
    return answer(0, i, 2, retry_ms(st.r, st.ur + 1 - st.rlim))
  end
  if st.tlim >= 0 and st.ut + cost > st.tlim then
    return answer(0, i, 1, retry_ms(st.t, st.ut + cost - st.tlim))
  end
  if st.paced then
    local need = math.min(cost, st.blim) * SCALE - st.level
    if need > 0 then return answer(0, i, 4, math.ceil(need / st.tlim)) end
  end
end

if mode == 'check' then return answer(1, 0, 0, 0) end
if rid == '' then
  for _, st in ipairs(states) do
    if st.clim >= 0 then return redis.error_reply('a scope with a concurrency cap needs the request id') end
  end
end

for i, key in ipairs(KEYS) do
  local st = states[i]
  redis.call('HINCRBY', key, 't' .. cur, cost)
  redis.call('HINCRBY', key, 'r' .. cur, 1)
  st.t[cur] = (st.t[cur] or 0) + cost
  st.r[cur] = (st.r[cur] or 0) + 1
  st.ut = st.ut + cost
  st.ur = st.ur + 1
  if st.clim >= 0 then
    redis.call('HSET', key, 'i' .. rid, num(now))
    st.inflight = st.inflight + 1
  end
  if st.paced then
    st.level = st.level - cost * SCALE
    redis.call('HSET', key, 'l', num(st.level), 'lm', num(now), 'lr', st.tlim, 'lb', st.blim)
    rearm(key, lease, st.inflight, st.level, st.tlim, st.blim)
  else
    rearm(key, lease, st.inflight, nil, 0, 0)
  end
end
return answer(1, 0, 0, 0)
