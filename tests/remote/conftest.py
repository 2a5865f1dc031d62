"""Fixtures for the remote tier: a real redis-server and page servers on 127.0.0.1, as subprocesses.

redis-server runs with `--save '' --appendonly no` on a free port; tests skip with the reason if
it is not installed (CI installs it: `apt-get install -y redis-server`).
"""

from __future__ import annotations

import uuid

import pytest

from remote_procs import PAGE, REDIS, RedisProc, ServerProc


@pytest.fixture(scope="session")
def redis_proc(tmp_path_factory):
    if REDIS is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    pytest.importorskip("redis", reason="the redis client is not installed (pip install redis)")
    r = RedisProc(tmp_path_factory.mktemp("redis"))
    yield r
    r.stop()


@pytest.fixture(scope="session")
def cluster(redis_proc, tmp_path_factory):
    """Three page servers of 48 MiB (192 slots of 256 KiB) sharing one prefix."""
    prefix = "t" + uuid.uuid4().hex[:8]
    logs = tmp_path_factory.mktemp("serve")
    servers = []
    try:
        for i in range(3):
            servers.append(ServerProc(redis_proc.url, f"s{i}", prefix, "48M", PAGE, ttl=5.0, log_dir=logs))
        yield {"url": redis_proc.url, "prefix": prefix, "servers": servers, "redis": redis_proc}
    finally:
        for s in servers:
            s.stop()


@pytest.fixture
def own_redis(tmp_path):
    """A redis-server of this test alone (to restart it, or to kill its servers)."""
    if REDIS is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    r = RedisProc(tmp_path)
    yield r
    r.stop()


@pytest.fixture
def spawn(tmp_path):
    """Start page servers for one test; all are stopped at its end."""
    made: list[ServerProc] = []

    def start(url: str, name: str, prefix: str, size: str = "16M", page: int = PAGE, ttl: float = 2.0,
              low_water: float = 0.02) -> ServerProc:
        s = ServerProc(url, name, prefix, size, page, ttl, low_water, log_dir=tmp_path)
        made.append(s)
        return s

    yield start
    for s in made:
        s.stop()
