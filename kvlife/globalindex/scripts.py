"""The index's Lua scripts. Each runs atomically on one Redis node; every key a script
names shares one hash tag, so each also runs on Redis Cluster."""

ACQUIRE = """
-- KEYS: fence counter, lease key, ban key   ARGV: ttl_ms
if redis.call('EXISTS', KEYS[3]) == 1 then
  return redis.error_reply('KVLBANNED lease revoked for this host')
end
local token = redis.call('INCR', KEYS[1])
redis.call('SET', KEYS[2], token, 'PX', ARGV[1])
local t = redis.call('TIME')
return {token, tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])}
"""

RENEW = """
-- KEYS: lease key   ARGV: token, ttl_ms
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('KVLLOST lease lost (expired or revoked)')
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
local t = redis.call('TIME')
return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[2])
"""

REVOKE = """
-- KEYS: fence counter, lease key, ban key   ARGV: ban_ms
redis.call('DEL', KEYS[2])
if tonumber(ARGV[1]) > 0 then redis.call('SET', KEYS[3], '1', 'PX', ARGV[1]) end
return redis.call('INCR', KEYS[1])
"""

RAISE_FLOOR = """
-- KEYS: bucket fence hash   ARGV: host, token   (floors only go up)
local cur = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if tonumber(ARGV[2]) > cur then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
return 1
"""

PUBLISH_STAGED = """
-- KEYS: bucket fence hash, then per chunk: record key, staged frame, frame (one bucket)
-- ARGV: host, token, lease deadline (ms, server clock), one record per chunk.
-- Refuses a token below the host's floor in the bucket (KVLSTALE) and a lease deadline
-- that passed (KVLEXPIRED); then all staged frames present or none published, each
-- renamed into place with its record written beside it.
local floor = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if tonumber(ARGV[2]) < floor then
  return redis.error_reply('KVLSTALE fencing token ' .. ARGV[2] .. ' < ' .. floor)
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if now > tonumber(ARGV[3]) then
  return redis.error_reply('KVLEXPIRED lease expired ' .. (now - tonumber(ARGV[3])) .. ' ms ago')
end
local n = (#KEYS - 1) / 3
for i = 0, n - 1 do
  if redis.call('EXISTS', KEYS[3 + 3 * i]) == 0 then
    return redis.error_reply('KVLNOSTAGE staged frame missing')
  end
end
for i = 0, n - 1 do
  redis.call('RENAME', KEYS[3 + 3 * i], KEYS[4 + 3 * i])
  redis.call('PERSIST', KEYS[4 + 3 * i])
  redis.call('SET', KEYS[2 + 3 * i], ARGV[4 + i])
end
return n
"""

PUBLISH_RECORDS = """
-- KEYS: bucket fence hash, record keys (one bucket)   ARGV: host, token, lease deadline
-- (ms, server clock), one record per record key.  The fence and lease checks of
-- PUBLISH_STAGED, once; returns the records replaced ('' where none), whose payloads the
-- caller then removes.
local floor = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if tonumber(ARGV[2]) < floor then
  return redis.error_reply('KVLSTALE fencing token ' .. ARGV[2] .. ' < ' .. floor)
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if now > tonumber(ARGV[3]) then
  return redis.error_reply('KVLEXPIRED lease expired ' .. (now - tonumber(ARGV[3])) .. ' ms ago')
end
local old = {}
for i = 2, #KEYS do
  old[i - 1] = redis.call('GET', KEYS[i]) or ''
  redis.call('SET', KEYS[i], ARGV[i + 2])
end
return old
"""

INVALIDATE = """
-- KEYS: epoch counter, rules hash   ARGV: rule without its epoch (msgpack tail)
local e = redis.call('INCR', KEYS[1])
redis.call('HSET', KEYS[2], e, ARGV[1])
return e
"""
