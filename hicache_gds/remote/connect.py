"""Directory URLs: one Redis primary, or a Sentinel-monitored primary that survives a failover.

    redis://[user:password@]host:port[/db]                      one Redis (``rediss://``: TLS)
    redis+sentinel://[user:password@]host:port[,host:port...]/service_name[?db=N]
    rediss+sentinel://...                                        the same, TLS to primary and sentinels

In the sentinel form the hosts are Sentinels; the client asks them for the primary of
``service_name`` (redis-py's ``Sentinel.master_for``) and asks again after a connection fails, so a
failover costs the calls in flight and nothing else. ``user:password`` authenticates to the
primary and the replicas; query options ``sentinel_username`` / ``sentinel_password`` to the
Sentinels themselves (Sentinels often run without AUTH). ``db`` picks the database (default 0).

Why Sentinel and not etcd: Redis is already the directory's one dependency, redis-py ships
Sentinel support, and the directory's Lua scripts (atomic slot allocation, publish, eviction) stay
as they are. What Sentinel lacks, a rollback-free log, is made up for by acked writes (``WAIT``)
and the directory epoch that fences everything written under an older primary (`scripts.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["DirectoryURL", "parse_url", "connect", "redact"]

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")


@dataclass(frozen=True)
class DirectoryURL:
    """A parsed sentinel URL (plain ``redis://`` URLs go to redis-py's ``from_url`` unparsed)."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    sentinel_kwargs: dict[str, Any] = field(default_factory=dict)


def _host_port(item: str) -> tuple[str, int]:
    item = item.strip()
    if item.startswith("["):  # [v6]:port
        host, _, rest = item[1:].partition("]")
        port = rest.lstrip(":")
    else:
        host, _, port = item.rpartition(":")
        if not host:
            host, port = port, ""
    return host, int(port or 26379)


def parse_url(url: str) -> DirectoryURL | None:
    """The sentinel form of `url`, or None for a plain Redis URL; ValueError if malformed."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SENTINEL_SCHEMES:
        return None
    netloc, _, path = rest.partition("/")
    path, _, query = path.partition("?")
    user = password = None
    if "@" in netloc:
        cred, _, netloc = netloc.rpartition("@")
        u, has_pw, p = cred.partition(":")
        user = unquote(u) or None
        password = unquote(p) if has_pw else None
    try:
        hosts = tuple(_host_port(h) for h in netloc.split(",") if h.strip())
    except ValueError as exc:
        raise ValueError(f"sentinel URL: bad host:port list {netloc!r}") from exc
    service = unquote(path.strip("/"))
    if not hosts or not service:
        raise ValueError("sentinel URL needs host:port[,host:port...]/service_name, e.g. "
                         "redis+sentinel://10.0.0.1:26379,10.0.0.2:26379/hicache")
    q = {k: v[-1] for k, v in parse_qs(query).items()}
    skw: dict[str, Any] = {}
    if "sentinel_password" in q:
        skw["password"] = q["sentinel_password"]
    if "sentinel_username" in q:
        skw["username"] = q["sentinel_username"]
    return DirectoryURL(hosts, service, int(q.get("db", 0)), user, password,
                        scheme.lower().startswith("rediss"), skw)


def connect(url: str, timeout: float) -> tuple[Any, Any]:
    """(redis client of the primary, Sentinel or None) for `url`; every call times out in `timeout` s."""
    import redis
    parsed = parse_url(url)
    from redis.backoff import NoBackoff
    from redis.retry import Retry
    # No retries inside redis-py: its default (10 tries, backoff up to 1 s) made one call to a
    # directory being restarted take 4-9 s, not `timeout`; `Directory` has its own back-off, and
    # the Sentinel pool asks for the primary again at the next call.
    opts = dict(socket_timeout=timeout, socket_connect_timeout=timeout, retry_on_timeout=False,
                health_check_interval=0, retry=Retry(NoBackoff(), 0))
    if parsed is None:
        return redis.Redis.from_url(url, **opts), None
    from redis.sentinel import Sentinel
    tls = {"ssl": True} if parsed.tls else {}
    sopts = {k: v for k, v in opts.items() if k != "retry_on_timeout"}
    sentinel = Sentinel(list(parsed.sentinels), sentinel_kwargs={**sopts, **tls, **parsed.sentinel_kwargs},
                        **opts, **tls)
    client = sentinel.master_for(parsed.service, db=parsed.db, username=parsed.username,
                                 password=parsed.password)
    return client, sentinel


def redact(url: str) -> str:
    """`url` with the password of its user part replaced by ``***`` (``redis://user:***@host``,
    ``rediss://:***@host``, and the sentinel forms, ``sentinel_password`` included): the URL may
    carry Redis AUTH credentials, and logs are not secret."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url if "@" not in url else "(unparsable url)"
    netloc, slash, tail = rest.partition("/")
    if "@" in netloc:
        cred, _, hosts = netloc.rpartition("@")
        user, has_pw, _ = cred.partition(":")
        if has_pw:
            netloc = f"{user}:***@{hosts}"
    if "sentinel_password=" in tail:
        import re
        tail = re.sub(r"(sentinel_password=)[^&]*", r"\1***", tail)
    return f"{scheme}://{netloc}{slash}{tail}"
