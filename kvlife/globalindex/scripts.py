"""The index's Lua scripts. Each runs atomically on one Redis node. The per-bucket
scripts name keys of one hash tag only, so they also run on Redis Cluster; the ``*_ALL``
scripts name the index's keys and every bucket's fence hash at once, for a single
server, where one script makes a lease grant or a revocation atomic everywhere.

A bucket's fence hash ``{kvl:NS:bNNN}:fence`` holds, per host, the lowest token still
accepted (``f:HOST``), the token of its current lease (``t:HOST``) and that lease's
deadline on this node's clock (``d:HOST``, ms), plus the index incarnation the hash
belongs to (``_inc``: a hash left by an index that lost its state is reset). Every
publication and every delete checks the host's lease there: token not below the floor,
the current lease's token, deadline not passed; nothing the client claims about time
is trusted.
"""

_NOW = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

_META = """
-- the index's identity: created with the first script that needs it
local function meta(k, fresh, buckets)
  if redis.call('EXISTS', k) == 0 then
    redis.call('HSET', k, 'incarnation', fresh, 'buckets', buckets)
  end
  return redis.call('HMGET', k, 'incarnation', 'buckets')
end
"""

_BUCKET = """
local function grant(k, host, token, ttl, inc, now)
  if redis.call('HGET', k, '_inc') ~= inc then
    redis.call('DEL', k)  -- floors and leases of an index that lost its state
    redis.call('HSET', k, '_inc', inc)
  end
  local floor = tonumber(redis.call('HGET', k, 'f:' .. host) or '0')
  if token < floor then
    return redis.error_reply('KVLSTALE fencing token ' .. token .. ' < ' .. floor)
  end
  redis.call('HSET', k, 'f:' .. host, token, 't:' .. host, token, 'd:' .. host, now + ttl)
  return now + ttl
end

local function held(k, host, token, now)
  local floor = tonumber(redis.call('HGET', k, 'f:' .. host) or '0')
  if token < floor then
    return redis.error_reply('KVLSTALE fencing token ' .. token .. ' < ' .. floor)
  end
  if tonumber(redis.call('HGET', k, 't:' .. host) or '0') ~= token then
    return redis.error_reply('KVLLOST lease of ' .. host .. ' not held (revoked or superseded)')
  end
  local d = tonumber(redis.call('HGET', k, 'd:' .. host) or '0')
  if now > d then
    return redis.error_reply('KVLEXPIRED lease expired ' .. (now - d) .. ' ms ago')
  end
  return nil
end

local function renew(k, host, token, ttl, now)
  local bad = held(k, host, token, now)
  if bad then
    return redis.error_reply('KVLLOST lease lost (' .. bad.err .. ')')
  end
  redis.call('HSET', k, 'd:' .. host, now + ttl)
  return now + ttl
end

local function revoke(k, host, token)
  local floor = tonumber(redis.call('HGET', k, 'f:' .. host) or '0')
  if token > floor then redis.call('HSET', k, 'f:' .. host, token) end
  if tonumber(redis.call('HGET', k, 't:' .. host) or '0') < token then
    redis.call('HDEL', k, 't:' .. host, 'd:' .. host)
  end
end

local function failed(r)
  return type(r) == 'table' and r.err ~= nil
end
"""

STATE = (
    _META
    + """
-- KEYS: meta hash, epoch counter   ARGV: a fresh incarnation id, buckets
local m = meta(KEYS[1], ARGV[1], ARGV[2])
return {m[1], m[2], tonumber(redis.call('GET', KEYS[2]) or '0')}
"""
)

INVALIDATE = (
    _META
    + """
-- KEYS: meta hash, epoch counter, rules hash   ARGV: fresh incarnation id, buckets, rule
-- A writer configured with another bucket count records nothing (KVLMISMATCH): it is
-- told so, and no host applies a rule whose call failed.
local m = meta(KEYS[1], ARGV[1], ARGV[2])
if tonumber(m[2]) ~= tonumber(ARGV[2]) then
  return redis.error_reply('KVLMISMATCH the index spreads keys over ' .. m[2] .. ' buckets')
end
local e = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[3], e, ARGV[3])
return {m[1], m[2], e}
"""
)

ACQUIRE = (
    _META
    + """
-- KEYS: meta hash, fence counter, ban key   ARGV: fresh incarnation id, buckets
-- A new token (the buckets grant it next: GRANT).
if redis.call('EXISTS', KEYS[3]) == 1 then
  return redis.error_reply('KVLBANNED lease revoked for this host')
end
local m = meta(KEYS[1], ARGV[1], ARGV[2])
return {redis.call('INCR', KEYS[2]), m[1], m[2]}
"""
)

GRANT = (
    _NOW
    + _BUCKET
    + """
-- KEYS: bucket fence hash   ARGV: host, token, ttl_ms, incarnation
return grant(KEYS[1], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4], now_ms())
"""
)

ACQUIRE_ALL = (
    _NOW
    + _META
    + _BUCKET
    + """
-- KEYS: meta hash, fence counter, ban key, every bucket's fence hash
-- ARGV: fresh incarnation id, buckets, host, ttl_ms.  ACQUIRE and every GRANT at once.
if redis.call('EXISTS', KEYS[3]) == 1 then
  return redis.error_reply('KVLBANNED lease revoked for this host')
end
local m = meta(KEYS[1], ARGV[1], ARGV[2])
local token = redis.call('INCR', KEYS[2])
local now = now_ms()
local d = 0
for i = 4, #KEYS do
  d = grant(KEYS[i], ARGV[3], token, tonumber(ARGV[4]), m[1], now)
  if failed(d) then return d end
end
return {token, m[1], m[2], d}
"""
)

RENEW = (
    _NOW
    + _BUCKET
    + """
-- KEYS: bucket fence hash (or every bucket's)   ARGV: host, token, ttl_ms
local now = now_ms()
local d = 0
for i = 1, #KEYS do
  d = renew(KEYS[i], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), now)
  if failed(d) then return d end
end
return d
"""
)

_BAN = """
-- a ban is extended, never shortened: a later revocation with a shorter ban (or none)
-- leaves the longer one in force
local function ban(k, ms)
  if ms > 0 and redis.call('PTTL', k) < ms then redis.call('SET', k, '1', 'PX', ms) end
end
"""

REVOKE = (
    _BAN
    + """
-- KEYS: fence counter, ban key   ARGV: ban_ms.  The token every bucket then refuses
-- the host below (REVOKE_BUCKET); the ban keeps the host from a new lease.
ban(KEYS[2], tonumber(ARGV[1]))
return redis.call('INCR', KEYS[1])
"""
)

REVOKE_BUCKET = (
    _BUCKET
    + """
-- KEYS: bucket fence hash   ARGV: host, token
revoke(KEYS[1], ARGV[1], tonumber(ARGV[2]))
return 1
"""
)

REVOKE_ALL = (
    _BUCKET
    + _BAN
    + """
-- KEYS: fence counter, ban key, every bucket's fence hash   ARGV: host, ban_ms
-- REVOKE and every REVOKE_BUCKET at once: no moment where the host is banned but
-- its lease still publishes somewhere.
local token = redis.call('INCR', KEYS[1])
for i = 3, #KEYS do revoke(KEYS[i], ARGV[1], token) end
ban(KEYS[2], tonumber(ARGV[2]))
return token
"""
)

PUBLISH_STAGED = (
    _NOW
    + _BUCKET
    + """
-- KEYS: bucket fence hash, then per chunk: record key, staged frame, frame (one bucket)
-- ARGV: host, token, one record per chunk.
-- Refuses unless the host holds its lease here (KVLSTALE: token below the floor,
-- revoked or superseded; KVLLOST: not the current lease; KVLEXPIRED: its deadline on
-- this node's clock passed); then all staged frames present or none published, each
-- renamed into place with its record written beside it.
local bad = held(KEYS[1], ARGV[1], tonumber(ARGV[2]), now_ms())
if bad then return bad end
local n = (#KEYS - 1) / 3
for i = 0, n - 1 do
  if redis.call('EXISTS', KEYS[3 + 3 * i]) == 0 then
    return redis.error_reply('KVLNOSTAGE staged frame missing')
  end
end
for i = 0, n - 1 do
  redis.call('RENAME', KEYS[3 + 3 * i], KEYS[4 + 3 * i])
  redis.call('PERSIST', KEYS[4 + 3 * i])
  redis.call('SET', KEYS[2 + 3 * i], ARGV[3 + i])
end
return n
"""
)

_SWAP_RECORDS = """
-- KEYS[first..] get ARGV[arg..] (one each); returns what each held before ('' where
-- nothing), in order, as a GET and a SET per key would (a key named twice: its second
-- record replaced its first). One MGET and one MSET per thousand keys instead: a third
-- less of the server's time for 256 records (measured).
local function swap_records(first, arg)
  local old = {}
  local written = {}
  for s = first, #KEYS, 1000 do
    local e = math.min(s + 999, #KEYS)
    local got = redis.call('MGET', unpack(KEYS, s, e))
    local kv = {}
    for i = s, e do
      local value = ARGV[i - first + arg]
      old[i - first + 1] = written[KEYS[i]] or got[i - s + 1] or ''
      written[KEYS[i]] = value
      kv[2 * (i - s) + 1] = KEYS[i]
      kv[2 * (i - s) + 2] = value
    end
    redis.call('MSET', unpack(kv))
  end
  return old
end
"""

PUBLISH_RECORDS = (
    _NOW
    + _BUCKET
    + _SWAP_RECORDS
    + """
-- KEYS: bucket fence hash, record keys (one bucket)   ARGV: host, token, one record per
-- record key.  The lease check of PUBLISH_STAGED, once; returns the records replaced
-- ('' where none), whose payloads the caller then removes.
local bad = held(KEYS[1], ARGV[1], tonumber(ARGV[2]), now_ms())
if bad then return bad end
return swap_records(2, 3)
"""
)

PUBLISH_RECORDS_ALL = (
    _NOW
    + _BUCKET
    + _SWAP_RECORDS
    + """
-- KEYS: the fence hash of every bucket the batch touches, then its record keys (one
-- server: the *_ALL scripts)   ARGV: host, token, how many fence hashes, one record per
-- record key.  The lease check of PUBLISH_STAGED in each of those buckets first, then
-- every record written: the whole batch or nothing, in one script where PUBLISH_RECORDS
-- takes one per bucket. Returns the records replaced ('' where none), in order.
local now = now_ms()
local token = tonumber(ARGV[2])
local fences = tonumber(ARGV[3])
for i = 1, fences do
  local bad = held(KEYS[i], ARGV[1], token, now)
  if bad then return bad end
end
return swap_records(fences + 1, 4)
"""
)

UNPUBLISH = (
    _NOW
    + _BUCKET
    + """
-- KEYS: bucket fence hash, then per chunk its record key and, when ARGV[3] is 2, its
-- frame key (one bucket)   ARGV: host, token, keys per chunk, the record each deleter
-- holds.  The lease check of PUBLISH_STAGED; then each record (and frame) is deleted
-- only if the record is still the one the deleter holds (a record published since is
-- someone else's). Returns 1 per chunk deleted, 0 per chunk kept.
local bad = held(KEYS[1], ARGV[1], tonumber(ARGV[2]), now_ms())
if bad then return bad end
local per = tonumber(ARGV[3])
local out = {}
for i = 0, (#KEYS - 1) / per - 1 do
  local rk = KEYS[2 + per * i]
  if redis.call('GET', rk) == ARGV[4 + i] then
    if per == 2 then redis.call('DEL', rk, KEYS[3 + per * i]) else redis.call('DEL', rk) end
    out[i + 1] = 1
  else
    out[i + 1] = 0
  end
end
return out
"""
)

RULES = """
-- KEYS: meta hash, rules hash   ARGV: the incarnation the caller read, epochs
-- The rules of those epochs, if the index is still that incarnation (else KVLRESET).
if redis.call('HGET', KEYS[1], 'incarnation') ~= ARGV[1] then
  return redis.error_reply('KVLRESET the index lost its state')
end
return redis.call('HMGET', KEYS[2], unpack(ARGV, 2))
"""
