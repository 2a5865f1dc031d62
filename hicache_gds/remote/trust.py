"""Proof that a page server's registration comes from the cluster: an HMAC over its record.

Anyone who can write to the directory's Redis could otherwise register a page server of their
own, and clients would write KV pages to it and read pages from it. With a cluster secret
configured, a server signs its record -- name, epoch, agent name, a SHA-256 digest of its NIXL
agent metadata (which holds its network address), pool base, slot size, slot count, host,
timestamp -- with HMAC-SHA-256 keyed by the secret, and clients skip (with a warning, counted in
`untrusted_servers`) every record whose proof is missing or wrong.

The secret comes from `cluster_secret_file` (config key, or ``HICACHE_GDS_CLUSTER_SECRET_FILE``), a
file readable by its owner only (mode 0600 or stricter: anything else is refused), or else from
``HICACHE_GDS_CLUSTER_SECRET``. Without one the tier trusts every record in Redis, as `doctor`
says. What the secret does not do: the tier trusts every client that holds it, and any such
client can read and overwrite every namespace's pages; tenants that must not see each other's
pages belong to separate clusters (separate page servers and secrets).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from typing import Mapping

__all__ = ["load_secret", "sign", "verify", "SECRET_ENV", "SECRET_FILE_ENV"]

SECRET_ENV = "HICACHE_GDS_CLUSTER_SECRET"
SECRET_FILE_ENV = "HICACHE_GDS_CLUSTER_SECRET_FILE"
SIGNED = ("sid", "epoch", "agent", "md", "base", "slot_bytes", "nslots", "host", "ts")
SIGNED_IF_PRESENT = ("tcp_tx",)  # fields later releases added: signed where a record has them


def load_secret(path: str = "", env: Mapping[str, str] | None = None) -> bytes | None:
    """The cluster secret, or None when none is configured. A secret file must be a regular
    file of its owner alone (no group or other permission bits): PermissionError otherwise."""
    env = os.environ if env is None else env
    path = path or env.get(SECRET_FILE_ENV, "")
    if path:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077:
            raise PermissionError(f"cluster secret file {path} must be a regular file with mode 0600 or stricter "
                                  f"(it is {stat.filemode(st.st_mode)}): chmod 600 {path}")
        with open(path, "rb") as f:
            secret = f.read().strip()
        if not secret:
            raise ValueError(f"cluster secret file {path} is empty")
        return secret
    val = env.get(SECRET_ENV, "")
    return val.encode() if val else None


def _message(fields: Mapping[str, str | bytes]) -> bytes:
    parts = []
    for name in SIGNED + tuple(n for n in SIGNED_IF_PRESENT if n in fields):
        v = fields.get(name, b"")
        v = v if isinstance(v, bytes) else str(v).encode()
        if name == "md":
            v = hashlib.sha256(v).hexdigest().encode()
        parts.append(name.encode() + b"=" + v)
    return b"\n".join(parts)


def sign(secret: bytes, fields: Mapping[str, str | bytes]) -> str:
    """The proof (hex HMAC-SHA-256) of a server record's `SIGNED` fields."""
    return hmac.new(secret, _message(fields), hashlib.sha256).hexdigest()


def verify(secret: bytes, fields: Mapping[str, str | bytes], mac: str | bytes) -> bool:
    """Whether `mac` proves `fields` (constant-time comparison)."""
    mac = mac.decode() if isinstance(mac, bytes) else mac
    return hmac.compare_digest(sign(secret, fields), mac or "")
