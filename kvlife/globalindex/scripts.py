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

PUBLISH = """
-- KEYS: bucket fence hash, record key [, staged frame, frame]
-- ARGV: host, token, lease deadline (ms, server clock), record
local floor = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if tonumber(ARGV[2]) < floor then
  return redis.error_reply('KVLSTALE fencing token ' .. ARGV[2] .. ' < ' .. floor)
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if now > tonumber(ARGV[3]) then
  return redis.error_reply('KVLEXPIRED lease expired ' .. (now - tonumber(ARGV[3])) .. ' ms ago')
end
if #KEYS >= 4 then
  if redis.call('EXISTS', KEYS[3]) == 0 then
    return redis.error_reply('KVLNOSTAGE staged frame missing')
  end
  redis.call('RENAME', KEYS[3], KEYS[4])
  redis.call('PERSIST', KEYS[4])
end
redis.call('SET', KEYS[2], ARGV[4])
return 1
"""

PUBLISH_RECORDS = """
-- KEYS: bucket fence hash, record keys (one bucket)   ARGV: host, token, lease deadline
-- (ms, server clock), one record per record key.  The fence and lease checks of
-- PUBLISH, once; returns the records replaced ('' where none), whose payloads the
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
