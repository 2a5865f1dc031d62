"""Where a remote get reads first, and how its pages get out: the tier's own staging.

Host pages are read into host staging, device pages into staging on the same GPU, so a READ still
running at a batch's deadline lands there, never in the caller's memory (`tier`'s docstring).
`copy_out` moves a completed request's pages to the caller; `wait_for_writers` makes a put of
device pages wait for the caller's stream first, as the NVMe store does.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

from .. import checksum
from ..engines.base import MemKind, TransferEngine
from ..layout import Pages
from ..store.staging import Staging, scatter, scatter_device

__all__ = ["Stagings"]


class Stagings:
    """Host staging, and staging per GPU that device pages live on (made at its first get)."""

    def __init__(self, engine: TransferEngine) -> None:
        self.engine = engine
        self.host = Staging(engine)
        self.devices: dict[str, Staging] = {}
        self.device_of = checksum.device_of  # the GPU of a device address (tests: host memory standing in)
        self._lock = threading.Lock()

    def for_pages(self, pages: Pages) -> Staging:
        if pages.kind is not MemKind.VRAM:
            return self.host
        dev = self.device_of(int(pages.addrs[0, 0]))
        with self._lock:
            stg = self.devices.get(str(dev))
            if stg is None:
                stg = self.devices[str(dev)] = Staging(self.engine, MemKind.VRAM, dev)
            return stg

    @staticmethod
    def copy_out(stg: Staging, dst: Pages, buf: Any, js: Sequence[int], page_bytes: int) -> None:
        """Staged pages `js` (one slot each in `buf`) to their places in `dst`; done on return."""
        if stg.kind is MemKind.VRAM:
            scatter_device(dst, buf, js, page_bytes, stg.device)
        else:
            for j in js:
                scatter(dst, buf, j, j + 1, page_bytes, page_bytes)

    def wait_for_writers(self, pages: Pages, idx: Sequence[int]) -> None:
        """Before a put of device pages: what wrote them on the caller's current stream has ended."""
        if idx and pages.kind is MemKind.VRAM:
            dev = self.device_of(int(pages.addrs[idx[0], 0]))
            if dev.type == "cuda":
                checksum.wait_for_current_stream(dev)

    def close(self) -> None:
        for stg in [self.host, *self.devices.values()]:
            stg.close()
