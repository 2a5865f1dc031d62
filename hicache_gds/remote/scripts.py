"""The remote tier's Redis schema and the Lua scripts that change it atomically.

Every change to the directory is one Lua script, so it is atomic without client-side locks.
`P` is the key prefix (default "hicache"), `sid` a page server's name, `ns` a namespace id.

    P:servers           set    sids that have registered (stale ones are skipped, then removed)
    P:srv:<sid>         hash   md (NIXL agent metadata), agent, base, slot_bytes, nslots, epoch, gen,
                               evictions, host, pid -- with a TTL the server's heartbeat refreshes:
                               when it lapses the server is dead and its entries read as misses
    P:free:<sid>        list   free slot numbers
    P:lru:<sid>         zset   published slot -> last use (microseconds, Redis TIME)
    P:pend:<sid>        zset   reserved slot -> lease deadline; an expired lease goes back to free
    P:own:<sid>         hash   slot -> "gen<TAB>ns<TAB>key" for reserved and published slots
    P:dir:<ns>          hash   key -> "sid|epoch|slot|gen|len|csum" (published pages only)

`epoch` is new at each (re)registration of a server: entries of an older epoch are misses, so a
server that restarted, or lost Redis, never serves another incarnation's slots. `gen` increases
with every reservation, so a reader can tell whether the slot it read was reused meanwhile.

Scripts touch the keys they are given and, on eviction, the `P:dir:<ns>` hash of the evicted
page (named in `P:own`): meant for one Redis instance, not Redis Cluster.
"""

from __future__ import annotations

__all__ = ["REGISTER", "FILL", "HEARTBEAT", "UNREGISTER", "RESERVE", "PUBLISH", "ABORT", "LOOKUP", "VALIDATE",
           "DELETE", "CLEAR", "ENTRY_SEP"]

ENTRY_SEP = "|"

# Shared helpers. ARGV[1] is always the prefix.
_PRELUDE = r"""
local P = ARGV[1]
local function skeys(sid)
  return P..':srv:'..sid, P..':free:'..sid, P..':lru:'..sid, P..':own:'..sid, P..':pend:'..sid
end
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local function parse(e)  -- sid, epoch, slot, gen of a directory entry
  return string.match(e, '^([^|]+)|([^|]+)|(%d+)|(%d+)|')
end
local alive_cache = {}
local function alive(sid, epoch)
  local cur = alive_cache[sid]
  if cur == nil then
    cur = redis.call('HGET', P..':srv:'..sid, 'epoch') or false
    alive_cache[sid] = cur
  end
  return cur == epoch
end
local function release(sid, slot)  -- a reserved or published slot back to the free list
  local srv, free, lru, own, pend = skeys(sid)
  redis.call('ZREM', pend, slot)
  redis.call('ZREM', lru, slot)
  redis.call('HDEL', own, slot)
  redis.call('RPUSH', free, slot)
end
local function evict_one(sid, epoch)  -- least recently used published slot; its entry is removed
  local srv, free, lru, own = skeys(sid)
  local top = redis.call('ZPOPMIN', lru)
  if #top == 0 then return nil end
  local slot = top[1]
  local o = redis.call('HGET', own, slot)
  if o then
    local ns, key = string.match(o, '^%d+\t([^\t]+)\t(.*)$')
    if ns then
      local dk = P..':dir:'..ns
      local e = redis.call('HGET', dk, key)
      if e then
        local es, ee, eslot = parse(e)
        if es == sid and ee == epoch and eslot == slot then redis.call('HDEL', dk, key) end
      end
    end
    redis.call('HDEL', own, slot)
  end
  redis.call('HINCRBY', srv, 'evictions', 1)
  return slot
end
local function reclaim(sid, now)  -- reservations whose lease ran out (their writer died or hung)
  local srv, free, lru, own, pend = skeys(sid)
  local old = redis.call('ZRANGEBYSCORE', pend, '-inf', now, 'LIMIT', 0, 1000)
  for _, s in ipairs(old) do release(sid, s) end
  return #old
end
local function drop_entries(sid, epoch)  -- every directory entry of this incarnation
  local srv, free, lru, own = skeys(sid)
  local all = redis.call('HGETALL', own)
  for i = 1, #all, 2 do
    local ns, key = string.match(all[i + 1], '^%d+\t([^\t]+)\t(.*)$')
    if ns then
      local dk = P..':dir:'..ns
      local e = redis.call('HGET', dk, key)
      if e then
        local es, ee, eslot = parse(e)
        if es == sid and ee == epoch and eslot == all[i] then redis.call('HDEL', dk, key) end
      end
    end
  end
end
"""

# KEYS: srv free lru own pend. ARGV: P sid epoch ttl_ms nslots field value ...
REGISTER = _PRELUDE + r"""
local sid, epoch, ttl, nslots = ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local srv, free, lru, own, pend = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local old = redis.call('HGET', srv, 'epoch')
if old then drop_entries(sid, old) end
redis.call('DEL', srv, free, lru, own, pend)
local fields = {'epoch', epoch, 'gen', 0, 'evictions', 0}
for i = 6, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', srv, unpack(fields))
for _, k in ipairs(KEYS) do redis.call('PEXPIRE', k, ttl) end
redis.call('SADD', P..':servers', sid)
return 1
"""

# KEYS: srv free. ARGV: P sid epoch ttl_ms first count -> 1, or 0 when this epoch is gone.
# The free list is filled after REGISTER in calls of a bounded size (`Directory.FILL_SLOTS`), so
# that a large pool never holds Redis for long: one script blocks every other client meanwhile.
FILL = r"""
local epoch, ttl, first, n = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
if redis.call('HGET', KEYS[1], 'epoch') ~= epoch then return 0 end
local chunk = {}
for s = first, first + n - 1 do
  chunk[#chunk + 1] = s
  if #chunk == 4000 then redis.call('RPUSH', KEYS[2], unpack(chunk)); chunk = {} end
end
if #chunk > 0 then redis.call('RPUSH', KEYS[2], unpack(chunk)) end
redis.call('PEXPIRE', KEYS[2], ttl)
return 1
"""

# KEYS: srv free lru own pend. ARGV: P sid epoch ttl_ms low_water. -> {-1} when this epoch is gone,
# else {free, used, pending, evictions}
HEARTBEAT = _PRELUDE + r"""
local sid, epoch, ttl, low = ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local srv, free, lru, own, pend = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
if redis.call('HGET', srv, 'epoch') ~= epoch then return {-1} end
for _, k in ipairs(KEYS) do redis.call('PEXPIRE', k, ttl) end
reclaim(sid, now_us())
while redis.call('LLEN', free) < low do
  local s = evict_one(sid, epoch)
  if not s then break end
  redis.call('RPUSH', free, s)
end
redis.call('SADD', P..':servers', sid)
return {redis.call('LLEN', free), redis.call('ZCARD', lru), redis.call('ZCARD', pend),
        tonumber(redis.call('HGET', srv, 'evictions'))}
"""

# KEYS: srv free lru own pend. ARGV: P sid epoch
UNREGISTER = _PRELUDE + r"""
local sid, epoch = ARGV[2], ARGV[3]
if redis.call('HGET', KEYS[1], 'epoch') ~= epoch then return 0 end
drop_entries(sid, epoch)
redis.call('DEL', unpack(KEYS))
redis.call('SREM', P..':servers', sid)
return 1
"""

# KEYS: srv free lru own pend dir. ARGV: P sid epoch lease_ms ns key...
# -> {slot, gen} per key; slot -2: already published, -1: no slot (all reserved). {-3}: stale epoch.
RESERVE = _PRELUDE + r"""
local sid, epoch, lease, ns = ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local srv, free, lru, own, pend, dir = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
if not alive(sid, epoch) then return {-3} end
local now = now_us()
reclaim(sid, now)
local out = {}
for i = 6, #ARGV do
  local key = ARGV[i]
  local e = redis.call('HGET', dir, key)
  if e then
    local es, ee = parse(e)
    if alive(es, ee) then e = true else redis.call('HDEL', dir, key); e = nil end
  end
  if e then
    out[#out + 1] = -2; out[#out + 1] = 0
  else
    local slot = redis.call('LPOP', free) or evict_one(sid, epoch)
    if slot then
      local gen = redis.call('HINCRBY', srv, 'gen', 1)
      redis.call('HSET', own, slot, gen..'\t'..ns..'\t'..key)
      redis.call('ZADD', pend, now + lease * 1000, slot)
      out[#out + 1] = tonumber(slot); out[#out + 1] = gen
    else
      out[#out + 1] = -1; out[#out + 1] = 0
    end
  end
end
return out
"""

# KEYS: srv free lru own pend dir. ARGV: P sid epoch ns (key slot gen len csum)...
# -> per item 1: published, 2: another copy was published first (our slot freed), 0: reservation lost
PUBLISH = _PRELUDE + r"""
local sid, epoch, ns = ARGV[2], ARGV[3], ARGV[4]
local srv, free, lru, own, pend, dir = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local out = {}
local ok = alive(sid, epoch)
local now = now_us()
for i = 5, #ARGV, 5 do
  local key, slot, gen, len, csum = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4]
  if not ok or redis.call('HGET', own, slot) ~= gen..'\t'..ns..'\t'..key
     or not redis.call('ZSCORE', pend, slot) then
    out[#out + 1] = 0
  else
    local e = redis.call('HGET', dir, key)
    local taken = false
    if e then local es, ee = parse(e); taken = alive(es, ee) end
    if taken then
      release(sid, slot)
      out[#out + 1] = 2
    else
      redis.call('HSET', dir, key, table.concat({sid, epoch, slot, gen, len, csum}, '|'))
      redis.call('ZREM', pend, slot)
      redis.call('ZADD', lru, now, slot)
      out[#out + 1] = 1
    end
  end
end
return out
"""

# KEYS: srv free lru own pend. ARGV: P sid epoch ns (key slot gen)...  -> number released
ABORT = _PRELUDE + r"""
local sid, epoch, ns = ARGV[2], ARGV[3], ARGV[4]
if not alive(sid, epoch) then return 0 end
local n = 0
for i = 5, #ARGV, 3 do
  local key, slot, gen = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if redis.call('HGET', KEYS[4], slot) == gen..'\t'..ns..'\t'..key and redis.call('ZSCORE', KEYS[5], slot) then
    release(sid, slot); n = n + 1
  end
end
return n
"""

# KEYS: dir. ARGV: P key... -> entry or false per key (entries of dead servers are removed)
LOOKUP = _PRELUDE + r"""
local out = {}
for i = 2, #ARGV do
  local e = redis.call('HGET', KEYS[1], ARGV[i])
  if e then
    local es, ee = parse(e)
    if not alive(es, ee) then redis.call('HDEL', KEYS[1], ARGV[i]); e = false end
  end
  out[#out + 1] = e or false
end
return out
"""

# KEYS: dir. ARGV: P (key entry)... -> 1 per key whose entry is unchanged (and LRU is touched), else 0
VALIDATE = _PRELUDE + r"""
local out = {}
local now = now_us()
for i = 2, #ARGV, 2 do
  local e = ARGV[i + 1]
  local es, ee, slot = parse(e)
  if redis.call('HGET', KEYS[1], ARGV[i]) == e and alive(es, ee) then
    redis.call('ZADD', P..':lru:'..es, 'XX', now, slot)
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
"""

_DELETE_ONE = r"""
local function delete_one(dir, ns, key)
  local e = redis.call('HGET', dir, key)
  if not e then return 0 end
  redis.call('HDEL', dir, key)
  local es, ee, slot, gen = parse(e)
  if alive(es, ee) and redis.call('HGET', P..':own:'..es, slot) == gen..'\t'..ns..'\t'..key then
    release(es, slot)
  end
  return 1
end
"""

# KEYS: dir. ARGV: P ns key... -> 1 per key that was present
DELETE = _PRELUDE + _DELETE_ONE + r"""
local out = {}
for i = 3, #ARGV do out[#out + 1] = delete_one(KEYS[1], ARGV[2], ARGV[i]) end
return out
"""

# KEYS: dir. ARGV: P ns -> number of pages removed
CLEAR = _PRELUDE + _DELETE_ONE + r"""
local n = 0
for _, key in ipairs(redis.call('HKEYS', KEYS[1])) do n = n + delete_one(KEYS[1], ARGV[2], key) end
return n
"""
