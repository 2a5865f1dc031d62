"""Posting requests to an engine: `post_rows`, and how reads of host pages pace their posting.

Where the device's queue is short (a small max_sectors_kb, few tags), posting a request blocks
until earlier IO completes, and a batch posted all at once left every checksum for after the IO
instead of beside it. A mover measures the share of its reads' time spent posting; past
`BLOCKING_POST_SHARE` its reads of host pages keep at most `READ_WINDOW_BYTES` (and at least
`READ_WINDOW_MIN` requests) posted ahead of the one waited for, so each request's pages are
verified while the next ones are read. Elsewhere everything is posted at once: a window costs
queue depth (5 % of a 1 GiB get on the CPU machine's disk).

The share is measured on reads posted all at once only (a window hides the blocking it is there
for, and judging by windowed reads flipped a blocking device back and forth); a windowed mover
posts every `WINDOW_PROBE_EVERY`-th read all at once to notice a device that stopped blocking.
Movers of one engine on the same devices share what they measured (`DEVICE_POST_SHARE`): a
store opened again in the process (SGLang's runtime backend switch, another namespace) starts
from it, where its first get, posted all at once on a blocking device, verified every page after
all of the IO.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from ..config import Config
from ..engines.base import MemKind, Op, Transfer, TransferEngine, split_batches, split_rows

__all__ = ["post_rows", "ReadPacing", "BLOCKING_POST_SHARE", "READ_WINDOW_BYTES", "READ_WINDOW_MIN", "WINDOW_PROBE_EVERY",
           "DEVICE_POST_SHARE"]

BLOCKING_POST_SHARE = 0.5
READ_WINDOW_BYTES = 512 << 20
READ_WINDOW_MIN = 2
WINDOW_PROBE_EVERY = 64
DEVICE_POST_SHARE: dict[tuple[Any, ...], float] = {}
"""The posting share last measured, by (engine name, ``st_dev`` of each slab file's device...)."""


def post_rows(engine: TransferEngine, config: Config, op: Op, kind: MemKind, mem: np.ndarray,
              fil: np.ndarray) -> list[Transfer]:
    """Submit (addr, nbytes) x (file id, file offset) rows in requests within the engine's limits
    (descriptors cut to ``max_desc_bytes``, requests to ``max_request_bytes`` or 64 MiB). On a
    failure to submit, what was posted is waited for (never past ``io_timeout``) and the error raised."""
    caps = engine.capabilities
    a, ln, off, pieces = split_rows(mem[:, 0], mem[:, 1], fil[:, 1], caps.max_desc_bytes)
    mem, fil = np.stack([a, ln], axis=1), np.stack([np.repeat(fil[:, 0], pieces), off], axis=1)
    out: list[Transfer] = []
    try:
        for bt in split_batches(np.ones(len(mem)), mem[:, 1], caps, config.max_request_bytes or 64 << 20):
            out.append(engine.submit(op, kind, mem[bt.row_start:bt.row_stop], fil[bt.row_start:bt.row_stop]))
    except BaseException:
        deadline = time.monotonic() + config.io_timeout
        for t in out:
            try:
                t.wait(max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 -- the submit error is the one to raise
                pass
            finally:
                t.release()
        raise
    return out


class ReadPacing:
    """How a mover's reads of host pages post (mixed into `PageMover`): the posting share it
    measured, shared through `DEVICE_POST_SHARE` by movers of one engine on the same devices."""

    engine: Any
    _post_share: float | None = None  # of recent reads' time, spent posting
    _devices: tuple[Any, ...] | None = None

    def _device_key(self) -> tuple[Any, ...]:
        """The engine and the devices under this mover's slab files (``st_dev``): the key of
        `DEVICE_POST_SHARE` (posting blocks in a device's queue, as one engine submits to it)."""
        if self._devices is None:
            devs = set()
            for path in getattr(getattr(self, "slabs", None), "paths", ()):
                try:
                    devs.add(os.stat(path).st_dev)
                except OSError:
                    pass
            self._devices = (getattr(self.engine, "name", ""), *sorted(devs))
        return self._devices

    def _share(self) -> float:
        """The posting share reads are judged by: this mover's, else what another mover measured
        on the same devices, else 0 (post all at once, and measure)."""
        if self._post_share is not None:
            return self._post_share
        return DEVICE_POST_SHARE.get(self._device_key(), 0.0)

    def _note_share(self, share: float) -> None:
        self._post_share = share if self._post_share is None else 0.5 * self._post_share + 0.5 * share
        DEVICE_POST_SHARE[self._device_key()] = self._post_share

    def _posting(self) -> dict[str, Any]:
        """How reads post their requests now (`stats()`): the share of their time spent posting,
        and whether reads of host pages post within a window (posting blocks on this device)."""
        share = self._share()
        windowed = share > BLOCKING_POST_SHARE
        return {"read_post_share": round(share, 3),
                "read_posting": f"within {READ_WINDOW_BYTES >> 20} MiB ahead" if windowed else "all at once"}
