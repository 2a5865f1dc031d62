"""Typed errors.

Every error subclasses the built-in a caller would already catch, so code that knows nothing of
hicache-gds still handles them sensibly (`OSError` for IO, `ValueError` for bad input,
`ImportError` for a missing engine).
"""

from __future__ import annotations

import io

__all__ = [
    "HiCacheGDSError",
    "ConfigError",
    "EngineUnavailable",
    "GDSUnavailable",
    "TransferError",
    "TransferTimeout",
    "StoreFullError",
    "StoreLockedError",
    "StoreClosedError",
    "ReadOnlyError",
    "RegionError",
    "DirectoryUnavailable",
    "PeerDisconnected",
]


class HiCacheGDSError(Exception):
    """Base of every error raised by hicache-gds."""


class ConfigError(HiCacheGDSError, ValueError):
    """A configuration key or value is not accepted; the message names the key and the accepted values."""


class EngineUnavailable(HiCacheGDSError, ImportError):
    """A transfer engine cannot run on this machine; the message says why."""


class GDSUnavailable(EngineUnavailable):
    """`ENABLE_GDS=1` was asked for but no GPU-direct engine can serve the path."""


class TransferError(HiCacheGDSError, OSError):
    """A transfer failed. The message names the engine, the operation and the file."""


class TransferTimeout(TransferError, TimeoutError):
    """A transfer did not complete within its timeout.

    The IO may still land later: callers must neither reuse the destination memory for other data
    nor publish or recycle the file slots of a timed-out write.
    """


class StoreFullError(HiCacheGDSError, OSError):
    """The storage directory has no room for the slab files (ENOSPC), or -- for a namespace sized by
    default -- none below `max_fill` while the namespaces holding the space are open."""


class StoreLockedError(HiCacheGDSError, OSError):
    """Another process has been opening (creating, sizing, recovering) the namespace for too long."""


class StoreClosedError(HiCacheGDSError, ValueError):
    """A call on a store that is closed, or closing (`close` waits for the calls in flight, then
    refuses new ones). A `ValueError`, as for a call on a closed file."""


class ReadOnlyError(HiCacheGDSError, io.UnsupportedOperation):
    """A write (`put`, `delete`, `clear`) on a namespace opened read-only (`PageReader`).

    Subclasses `io.UnsupportedOperation` (an `OSError` and a `ValueError`), what Python raises for
    a write to a file opened for reading.
    """


class RegionError(HiCacheGDSError, ValueError):
    """A memory region is outside every registered buffer, misaligned, or of the wrong size."""


class DirectoryUnavailable(HiCacheGDSError, ConnectionError):
    """Redis cannot be reached, or did not answer in time; the remote tier treats it as misses."""


class PeerDisconnected(TransferError):
    """The remote agent went away (process died or connection lost); its pages are misses."""
