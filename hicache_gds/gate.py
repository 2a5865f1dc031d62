"""`CallGate`: the calls in flight on a store, so that `close` never pulls the engine, the files or
the index from under them.

Every public call of a store runs inside `call()`; `close(bound, teardown)` refuses new calls
(`StoreClosedError`), waits up to `bound` seconds for the calls in flight to return, then runs
`teardown`. Calls still in flight after that (a drive that stopped answering: each call's IO wait
is bounded by ``io_timeout``, but a call may make several) keep everything they use: the last of
them runs `teardown` as it returns. So a call never sees a closed engine or index (no raw
``CancelledError`` or "index is closed" out of a put), and its reserved slots are settled by the
call itself -- published, released, or kept reserved when their IO may still land -- before the
index closes.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

from .errors import StoreClosedError

__all__ = ["CallGate", "gated"]

log = logging.getLogger("hicache_gds.store")
_F = TypeVar("_F", bound=Callable[..., Any])


class CallGate:
    def __init__(self, what: str) -> None:
        self.what = what
        self._cv = threading.Condition()
        self._calls = 0
        self.closed = False
        self._teardown: Callable[[], None] | None = None

    @contextmanager
    def call(self) -> Iterator[None]:
        """One call: refused with `StoreClosedError` once `close` began."""
        with self._cv:
            if self.closed:
                raise StoreClosedError(f"{self.what} is closed")
            self._calls += 1
        try:
            yield
        finally:
            with self._cv:
                self._calls -= 1
                last = self._calls == 0
                teardown = self._teardown if last else None
                if teardown is not None:
                    self._teardown = None
                if last:
                    self._cv.notify_all()
            if teardown is not None:  # close() deferred it to the last call: never this call's error
                try:
                    teardown()
                except Exception:  # noqa: BLE001
                    log.exception("hicache-gds: closing %s after its last call failed", self.what)

    def close(self, bound: float, teardown: Callable[[], None]) -> int:
        """Refuse new calls, wait up to `bound` s for those in flight, and run `teardown` now, or
        when the last of them returns. Returns how many were still in flight (0: torn down now).
        Idempotent: a second close returns 0 and does nothing."""
        with self._cv:
            if self.closed:
                return 0
            self.closed = True
            end = time.monotonic() + bound
            while self._calls:
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            busy = self._calls
            if busy:
                self._teardown = teardown
                return busy
        teardown()
        return 0


def gated(fn: _F) -> _F:
    """Run a method of an object with a `_gate` (a `CallGate`) inside `call()`."""
    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._gate.call():
            return fn(self, *args, **kwargs)
    return wrapper  # type: ignore[return-value]
