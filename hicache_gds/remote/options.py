"""`RemoteOptions`: the remote tier's settings, read from a `Config` and its dict of overrides."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

from ..config import ENV_PREFIX, Config

__all__ = ["RemoteOptions", "REMOTE_KEYS"]


@dataclass(frozen=True)
class RemoteOptions:
    """Remote-tier settings. Config keys: `remote_url`, `remote_prefix`, `remote_timeout`, `remote_lease`,
    `remote_wait_replicas`, `remote_wait_ms`, `cluster_secret_file` (each also `HICACHE_GDS_<KEY>`)."""

    url: str = "redis://127.0.0.1:6379/0"
    prefix: str = "hicache"
    redis_timeout: float = 2.0
    """Seconds one Redis call may take."""
    io_timeout: float = 10.0
    """Seconds one batch's transfers may take (from `io_timeout`)."""
    lease: float = 0.0
    """Seconds a reserved slot stays reserved for a writer that never publishes (0: 2*io_timeout + 10)."""
    refresh: float = 1.0
    """Seconds between refreshes of the live server list."""
    threads: int = 2
    """Threads that hash pages in parallel; one of them polls a batch's transfers (UCX over cma copies there)."""
    request_bytes: int = 64 << 20
    """Batches are cut into requests of at most this many bytes, spread over `threads`."""
    verify: bool = True
    """Check host pages' xxh3 checksums after reading (from `verify`)."""
    wait_replicas: int = 1
    """Replicas that must acknowledge (Redis WAIT) a registration, publish or delete before it
    counts as done; capped by the replicas attached, so a Redis without one waits for none. 0: off."""
    wait_ms: int = 1000
    """Milliseconds to wait for that acknowledgement; a write not acknowledged in time failed."""
    cluster_secret_file: str = ""
    """File (mode 0600) holding the cluster secret that signs page servers' records (`trust.py`);
    "": HICACHE_GDS_CLUSTER_SECRET_FILE, else the secret in HICACHE_GDS_CLUSTER_SECRET, else none."""
    net_devices: str = ""
    """UCX_NET_DEVICES for this process when unset in the environment ("": UCX's choice, every
    device; the variable is process-wide, so other UCX users in a serving process see it too)."""

    @classmethod
    def from_config(cls, cfg: Config, overrides: Mapping[str, Any] | None = None,
                    env: Mapping[str, str] | None = None) -> "RemoteOptions":
        """Dict key > `Config` field (once the core declares it) > `HICACHE_GDS_<KEY>` > default."""
        env = os.environ if env is None else env
        overrides = overrides or {}
        out: dict[str, Any] = {"io_timeout": cfg.io_timeout, "verify": cfg.verify}
        for key, attr in REMOTE_KEYS.items():
            if key in overrides:
                val = overrides[key]
            elif hasattr(cfg, key):
                val = getattr(cfg, key)
            else:
                val = env.get(ENV_PREFIX + key.upper(), "")
            default = getattr(cls, attr)
            out[attr] = default if val in ("", None) else type(default)(val)
        return cls(**out)

    def directory_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `Directory` beyond url, prefix and timeout."""
        from .trust import load_secret
        return {"wait_replicas": self.wait_replicas, "wait_ms": self.wait_ms,
                "secret": load_secret(self.cluster_secret_file)}


REMOTE_KEYS = {"remote_url": "url", "remote_prefix": "prefix", "remote_timeout": "redis_timeout",
               "remote_lease": "lease", "remote_wait_replicas": "wait_replicas", "remote_wait_ms": "wait_ms",
               "cluster_secret_file": "cluster_secret_file"}
assert set(REMOTE_KEYS.values()) <= {f.name for f in fields(RemoteOptions)}
