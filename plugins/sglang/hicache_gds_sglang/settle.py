"""What ending a split tail's operations shares across SGLang releases (`split._settle` on 0.5.17,
`split_0523._settle` on 0.5.23): cancelling the reads not yet posted, and keeping the leading
complete pages for the caller. Each release frees and releases the rest its own way."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("hicache_gds_sglang.policy")


def cancel_reads(backend: Any, host_indices: Any) -> None:
    """Skip the reads of `host_indices` not yet posted (`HiCacheGDS.cancel_read`); those already
    posted run to their end and are released with the rest."""
    if host_indices is None or backend is None or not callable(getattr(backend, "cancel_read", None)):
        return
    try:
        backend.cancel_read(host_indices)
    except Exception as exc:  # noqa: BLE001 -- they are read, then released as the caller releases them
        log.warning("hicache-gds policy: cancelling a split tail's reads failed (%s: %s); they run to the end",
                    type(exc).__name__, exc)


class Kept:
    """The tail's pages complete in token order from its start, of which the first `keep` tokens
    stay the caller's to insert. Feed it the tail's operations in order (`take`, or `broken` where
    one is gone); `result` gives (leading tokens complete, the kept host indices, their hashes)."""

    def __init__(self, keep: int, page_size: int) -> None:
        self.keep, self.ps = int(keep), int(page_size)
        self.lead, self.contiguous = 0, True
        self._hi: list = []
        self._hv: list = []

    def broken(self) -> None:
        """An operation without host pages (revoked, or none allocated): nothing past it joins."""
        self.contiguous = False

    def take(self, host_indices: Any, hashes: Any, usable: int, key_tokens: int) -> int:
        """One operation: `usable` whole-page tokens complete of its `key_tokens`. Returns how many
        of them are kept (the caller frees the others)."""
        mine = min(usable, max(0, self.keep - self.lead)) if self.contiguous else 0
        if mine:
            self._hi.append(host_indices[:mine])
            self._hv.extend(list(hashes)[:mine // self.ps])
        if self.contiguous:
            self.lead += usable
            self.contiguous = usable >= key_tokens
        return mine

    def result(self) -> tuple[int, Any, list]:
        import torch
        return self.lead, (torch.cat(self._hi) if self._hi else None), self._hv
