"""The remote tier's Redis schema and the Lua scripts that change it atomically.

Every change to the directory is one Lua script, so it is atomic without client-side locks. Every
key a script touches is named in its KEYS (none is built inside a script), and every key of one
deployment carries the hash tag ``{P}`` (`P` the prefix, default "hicache"), so each script's keys
share one Redis Cluster slot. `sid` is a page server's name, `ns` a namespace id.

    {P}:servers          set    sids that have registered (stale ones are skipped, then removed)
    {P}:ver              string bumped at each (un)registration: clients reload server records only then
    {P}:alive            hash   sid -> "epoch|deadline_us": the live registration and its lease (the
                                heartbeat moves the deadline; past it the server is dead, its entries misses)
    {P}:srv:<sid>        hash   md (NIXL agent metadata), agent, base, slot_bytes, nslots, epoch, gen, dep,
                                evictions, host, pid, ts, mac (the cluster-secret proof, `trust.py`) -- with
                                the heartbeat's TTL, as the four keys below
    {P}:free:<sid>       list   free slot numbers
    {P}:lru:<sid>        zset   published slot -> last use (microseconds, Redis TIME)
    {P}:pend:<sid>       zset   reserved slot -> lease deadline; an expired lease goes back to free
    {P}:own:<sid>        hash   slot -> "dep:gen<TAB>ns<TAB>key" for reserved and published slots
                                (dep ends in "q" for a slot reserved within a lease of a failover)
    {P}:dir              hash   "ns<TAB>key" -> "sid|epoch|slot|gen|len|csum|dep" (published pages only;
                                dep "<epoch>q": reserved within a lease of a failover, checksum required)
    {P}:fence            hash   epoch (the directory epoch), id (run_id:replid of the primary that
                                wrote it), bumped (when the epoch last changed, us), sweep (a cursor)

`epoch` (a server's) is new at each (re)registration: entries of an older one are misses, so a
server that restarted never serves another incarnation's slots. `gen` increases with every
reservation, so a reader can tell whether the slot it read was reused meanwhile.

The directory epoch `dep` fences everything written under an older primary. Every script that
writes first compares the primary's identity (``INFO`` run_id and master_replid: both change when
a replica is promoted, and a restart, e.g. from an older RDB, changes run_id) with the one recorded
in ``{P}:fence``; when they differ the epoch is raised, before anything else is written. Why that
is enough, after a failover that lost the last writes (an async replica promoted, an old RDB):

* the rolled-back state is a consistent, earlier state (replication and RDB keep order); what
  refers to the lost suffix lives outside Redis: entries readers hold, reservations writers hold,
  and bytes written into slots the lost suffix had handed out;
* a reservation carries ``dep:gen``; PUBLISH compares it with the current epoch, so no reservation
  made before the failover is ever published after it (``gen`` may repeat after a rollback,
  ``dep:gen`` never does), and an entry written after it never equals one of the lost suffix: a
  reader's VALIDATE, an exact comparison, fails for every entry it looked up before the rollback;
* entries that survived (``dep`` older than the current epoch) may name a slot the lost suffix
  reused, so its bytes are another page's: clients serve such an entry only after its checksum
  verifies, whatever their `verify` setting (`tier.py`);
* a write the lost suffix started may still land for up to a lease after the failover, in a slot
  the rolled-back state hands out again. RESERVE marks every reservation it makes within a lease
  of the epoch change (its ``dep`` carries a ``q``: ``depq:gen``), and PUBLISH writes the mark into
  the entry's ``dep`` field; readers treat a marked entry as they treat one of an older epoch
  (served only once its checksum verifies, `Directory.is_stale`), so a late write that lands over
  such a page makes it a miss, never another page's bytes. Puts resume as soon as the new
  primary answers; before, RESERVE handed out no slot for a whole lease.

Acked writes (``WAIT``, `Directory`) make the lost suffix hold unacknowledged writes only.
"""

from __future__ import annotations

__all__ = ["REGISTER", "FILL", "HEARTBEAT", "UNREGISTER", "RESERVE", "PUBLISH", "ABORT", "LOOKUP", "VALIDATE",
           "DELETE", "CLEAR", "ENTRY_SEP"]

ENTRY_SEP = "|"
FIELD_SEP = "\t"

_PRELUDE = r"""
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local function fence(fk)  -- the directory epoch; raised when the primary is not the one recorded
  local a = string.match(redis.call('INFO', 'server'), 'run_id:(%w+)')
  local b = string.match(redis.call('INFO', 'replication'), 'master_replid:(%w+)')
  local id = a..':'..b
  local f = redis.call('HMGET', fk, 'epoch', 'id', 'bumped')
  if f[2] == id then return tonumber(f[1]), tonumber(f[3] or 0) end
  local ep = math.max((tonumber(f[1]) or 0) + 1, now_us())  -- never repeats, even after a restart empty
  local bumped = 0
  if f[2] then bumped = now_us() end  -- a primary before this one: mark what is reserved for a lease
  redis.call('HSET', fk, 'epoch', string.format('%d', ep), 'id', id, 'bumped', string.format('%d', bumped))
  return ep, bumped
end
local function parse(e)  -- sid, epoch, slot, gen of a directory entry
  return string.match(e, '^([^|]+)|([^|]+)|(%d+)|(%d+)|')
end
local alive_cache = {}
local function alive(ak, sid, epoch)
  local cur = alive_cache[sid]
  if cur == nil then
    cur = false
    local a = redis.call('HGET', ak, sid)
    if a then
      local ep, dl = string.match(a, '^([^|]+)|(%d+)$')
      if tonumber(dl) > now_us() then cur = ep end
    end
    alive_cache[sid] = cur
  end
  return cur == epoch
end
local function release(free, lru, own, pend, slot)  -- a reserved or published slot back to the free list
  redis.call('ZREM', pend, slot)
  redis.call('ZREM', lru, slot)
  redis.call('HDEL', own, slot)
  redis.call('RPUSH', free, slot)
end
local function evict_one(srv, lru, own, dir, sid, epoch)  -- the LRU published slot; its entry is removed
  local top = redis.call('ZPOPMIN', lru)
  if #top == 0 then return nil end
  local slot = top[1]
  local o = redis.call('HGET', own, slot)
  if o then
    local f = string.match(o, '^[^\t]+\t(.*)$')
    local e = f and redis.call('HGET', dir, f)
    if e then
      local es, ee, eslot = parse(e)
      if es == sid and ee == epoch and eslot == slot then redis.call('HDEL', dir, f) end
    end
    redis.call('HDEL', own, slot)
  end
  redis.call('HINCRBY', srv, 'evictions', 1)
  return slot
end
local function reclaim(free, lru, own, pend, now)  -- reservations whose lease ran out
  local old = redis.call('ZRANGEBYSCORE', pend, '-inf', now, 'LIMIT', 0, 1000)
  for _, s in ipairs(old) do release(free, lru, own, pend, s) end
  return #old
end
"""

# KEYS: srv free lru own pend alive fence servers ver. ARGV: sid epoch ttl_ms nslots field value ...
# -> the directory epoch. The pool's old keys are UNLINKed (freed in the background) and its old
# entries left to read as misses (a sweep removes them): no step is proportional to the pool.
REGISTER = _PRELUDE + r"""
local sid, epoch, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local dep = fence(KEYS[7])
redis.call('UNLINK', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5])
local fields = {'epoch', epoch, 'gen', 0, 'evictions', 0, 'dep', string.format('%d', dep)}
for i = 5, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(fields))
for i = 1, 5 do redis.call('PEXPIRE', KEYS[i], ttl) end
redis.call('HSET', KEYS[6], sid, epoch..'|'..string.format('%d', now_us() + ttl * 1000))
redis.call('SADD', KEYS[8], sid)
redis.call('INCR', KEYS[9])
return dep
"""

# KEYS: srv free. ARGV: epoch ttl_ms first count -> 1, or 0 when this epoch is gone.
# The free list is filled after REGISTER in calls of a bounded size (`Directory.FILL_SLOTS`).
FILL = r"""
local epoch, ttl, first, n = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
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

# KEYS: srv free lru own pend dir alive fence servers. ARGV: sid epoch ttl_ms low_water max_evict sweep
# -> {-1} when this epoch is gone, else {free, used, pending, evictions, dep}. Evicts at most
# max_evict pages and sweeps `sweep` directory fields (entries of dead registrations) per call.
HEARTBEAT = _PRELUDE + r"""
local sid, epoch, ttl, low = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local srv, free, lru, own, pend, dir, ak = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local dep = fence(KEYS[8])
if redis.call('HGET', srv, 'epoch') ~= epoch then return {-1} end
for i = 1, 5 do redis.call('PEXPIRE', KEYS[i], ttl) end
redis.call('HSET', ak, sid, epoch..'|'..string.format('%d', now_us() + ttl * 1000))
reclaim(free, lru, own, pend, now_us())
local n = 0
while n < tonumber(ARGV[5]) and redis.call('LLEN', free) < low do
  local s = evict_one(srv, lru, own, dir, sid, epoch)
  if not s then break end
  redis.call('RPUSH', free, s)
  n = n + 1
end
local sc = redis.call('HSCAN', dir, redis.call('HGET', KEYS[8], 'sweep') or '0', 'COUNT', tonumber(ARGV[6]))
for i = 1, #sc[2], 2 do
  local es, ee = parse(sc[2][i + 1])
  if not alive(ak, es, ee) then redis.call('HDEL', dir, sc[2][i]) end
end
redis.call('HSET', KEYS[8], 'sweep', sc[1])
redis.call('SADD', KEYS[9], sid)
return {redis.call('LLEN', free), redis.call('ZCARD', lru), redis.call('ZCARD', pend),
        tonumber(redis.call('HGET', srv, 'evictions')), dep}
"""

# KEYS: srv free lru own pend alive servers ver. ARGV: sid epoch
UNREGISTER = r"""
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[2] then return 0 end
redis.call('UNLINK', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5])
redis.call('HDEL', KEYS[6], ARGV[1])
redis.call('SREM', KEYS[7], ARGV[1])
redis.call('INCR', KEYS[8])
return 1
"""

# KEYS: srv free lru own pend dir alive fence. ARGV: sid epoch lease_ms ns key...
# -> {slot, gen} per key; slot -2: already published, -1: no slot (all reserved). {-3}: stale epoch.
# A reservation within a lease of a new directory epoch is marked (`depq`): see the module's notes.
RESERVE = _PRELUDE + r"""
local sid, epoch, lease, ns = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local srv, free, lru, own, pend, dir, ak = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local dep, bumped = fence(KEYS[8])
if not alive(ak, sid, epoch) then return {-3} end
local now = now_us()
local tag = string.format('%d', dep)
if bumped > 0 and now < bumped + lease * 1000 then tag = tag..'q' end  -- a late write may land here
reclaim(free, lru, own, pend, now)
local out = {}
for i = 5, #ARGV do
  local f = ns..'\t'..ARGV[i]
  local e = redis.call('HGET', dir, f)
  if e then
    local es, ee = parse(e)
    if alive(ak, es, ee) then e = true else redis.call('HDEL', dir, f); e = nil end
  end
  if e then
    out[#out + 1] = -2; out[#out + 1] = 0
  else
    local slot = redis.call('LPOP', free) or evict_one(srv, lru, own, dir, sid, epoch)
    if slot then
      local gen = redis.call('HINCRBY', srv, 'gen', 1)
      redis.call('HSET', own, slot, tag..':'..gen..'\t'..f)
      redis.call('ZADD', pend, now + lease * 1000, slot)
      out[#out + 1] = tonumber(slot); out[#out + 1] = gen
    else
      out[#out + 1] = -1; out[#out + 1] = 0
    end
  end
end
return out
"""

# KEYS: srv free lru own pend dir alive fence. ARGV: sid epoch ns (key slot gen len csum)...
# -> per item 1: published, 2: another copy was published first (our slot freed), 0: reservation
# lost (lapsed, or made under an older directory epoch)
PUBLISH = _PRELUDE + r"""
local sid, epoch, ns = ARGV[1], ARGV[2], ARGV[3]
local srv, free, lru, own, pend, dir, ak = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local dep = string.format('%d', fence(KEYS[8]))
local out = {}
local ok = alive(ak, sid, epoch)
local now = now_us()
for i = 4, #ARGV, 5 do
  local key, slot, gen, len, csum = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4]
  local f = ns..'\t'..key
  local o = redis.call('HGET', own, slot)
  local tag = dep
  if o == dep..'q:'..gen..'\t'..f then tag = dep..'q' end  -- reserved just after a failover: mark the entry
  if not ok or o ~= tag..':'..gen..'\t'..f or not redis.call('ZSCORE', pend, slot) then
    out[#out + 1] = 0
  else
    local e = redis.call('HGET', dir, f)
    local taken = false
    if e then local es, ee = parse(e); taken = alive(ak, es, ee) end
    if taken then
      release(free, lru, own, pend, slot)
      out[#out + 1] = 2
    else
      redis.call('HSET', dir, f, table.concat({sid, epoch, slot, gen, len, csum, tag}, '|'))
      redis.call('ZREM', pend, slot)
      redis.call('ZADD', lru, now, slot)
      out[#out + 1] = 1
    end
  end
end
return out
"""

# KEYS: srv free lru own pend alive fence. ARGV: sid epoch ns (key slot gen)...  -> number released
ABORT = _PRELUDE + r"""
local dep = string.format('%d', fence(KEYS[7]))
if not alive(KEYS[6], ARGV[1], ARGV[2]) then return 0 end
local n = 0
for i = 4, #ARGV, 3 do
  local key, slot, gen = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local o, rest = redis.call('HGET', KEYS[4], slot), ':'..gen..'\t'..ARGV[3]..'\t'..key
  if (o == dep..rest or o == dep..'q'..rest) and redis.call('ZSCORE', KEYS[5], slot) then
    release(KEYS[2], KEYS[3], KEYS[4], KEYS[5], slot); n = n + 1
  end
end
return n
"""

# KEYS: dir alive fence. ARGV: ns key... -> {dep, entry or false per key} (dead servers' entries removed)
LOOKUP = _PRELUDE + r"""
local dep = fence(KEYS[3])
local out = {dep}
for i = 2, #ARGV do
  local f = ARGV[1]..'\t'..ARGV[i]
  local e = redis.call('HGET', KEYS[1], f)
  if e then
    local es, ee = parse(e)
    if not alive(KEYS[2], es, ee) then redis.call('HDEL', KEYS[1], f); e = false end
  end
  out[#out + 1] = e or false
end
return out
"""

# KEYS: dir alive lru(sid1) lru(sid2)... ARGV: ns nsids sid1 sid2 ... (key entry)...
# -> 1 per key whose entry is unchanged (its LRU time is touched), else 0
VALIDATE = _PRELUDE + r"""
local lrus, nsid = {}, tonumber(ARGV[2])
for j = 1, nsid do lrus[ARGV[2 + j]] = KEYS[2 + j] end
local out = {}
local now = now_us()
for i = 3 + nsid, #ARGV, 2 do
  local e = ARGV[i + 1]
  local es, ee, slot = parse(e)
  if redis.call('HGET', KEYS[1], ARGV[1]..'\t'..ARGV[i]) == e and alive(KEYS[2], es, ee) then
    if lrus[es] then redis.call('ZADD', lrus[es], 'XX', now, slot) end
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
"""

# Shared by DELETE and CLEAR. KEYS: dir alive, then free lru own pend of each server ARGV names
# (ARGV[1] ns, ARGV[2] the number of servers, then their sids). delete_one -> 1 removed, 0 absent,
# 2 not removed: a live server this call was not given (the caller retries with its keys).
_DELETE_ONE = r"""
local srvk, nsid = {}, tonumber(ARGV[2])
for j = 1, nsid do local b = 2 + 4 * (j - 1); srvk[ARGV[2 + j]] = {KEYS[b + 1], KEYS[b + 2], KEYS[b + 3], KEYS[b + 4]} end
local function delete_one(f)
  local e = redis.call('HGET', KEYS[1], f)
  if not e then return 0 end
  local es, ee, slot, gen = parse(e)
  if not alive(KEYS[2], es, ee) then redis.call('HDEL', KEYS[1], f); return 1 end
  local k = srvk[es]
  if not k then return 2 end
  redis.call('HDEL', KEYS[1], f)
  local o = redis.call('HGET', k[3], slot)
  if o and string.match(o, '^[^:]+:(%d+)\t') == gen and string.sub(o, -#f - 1) == '\t'..f then
    release(k[1], k[2], k[3], k[4], slot)
  end
  return 1
end
"""

# KEYS/ARGV as _DELETE_ONE, then key... -> per key 1 present (removed), 0 absent, 2 retry
DELETE = _PRELUDE + _DELETE_ONE + r"""
local out = {}
for i = 3 + nsid, #ARGV do out[#out + 1] = delete_one(ARGV[1]..'\t'..ARGV[i]) end
return out
"""

# KEYS/ARGV as _DELETE_ONE, then cursor count pattern -> {next cursor, removed, to retry}: one
# bounded HSCAN step over the directory (the caller loops until the cursor is "0").
CLEAR = _PRELUDE + _DELETE_ONE + r"""
local c = 3 + nsid
local sc = redis.call('HSCAN', KEYS[1], ARGV[c], 'MATCH', ARGV[c + 2], 'COUNT', tonumber(ARGV[c + 1]))
local n, retry = 0, 0
for i = 1, #sc[2], 2 do
  local r = delete_one(sc[2][i])
  if r == 2 then retry = retry + 1 else n = n + r end
end
return {sc[1], n, retry}
"""
