"""`batch.wait_each`: one thread waits for a batch's requests, all of them in flight at once."""

from __future__ import annotations

import time

from hicache_gds.engines.base import Op, Transfer
from hicache_gds.errors import TransferError, TransferTimeout
from hicache_gds.remote.batch import wait_each


class _Req(Transfer):
    """Posted at its first poll (as NIXL requests are); complete after `polls` more, or failing."""

    def __init__(self, log: list[str], name: str, polls: int, fail: bool = False) -> None:
        super().__init__("fake", Op.WRITE, 1, name)
        self.log, self.name, self.left, self.fail = log, name, polls, fail
        self.posted = False

    def _poll(self) -> bool:
        if not self.posted:
            self.posted = True
            self.log.append(f"post {self.name}")
            return False
        if self.fail:
            raise TransferError(f"{self.name} failed")
        self.left -= 1
        if self.left <= 0:
            self.log.append(f"done {self.name}")
            return True
        return False


def test_every_request_is_posted_before_any_completes():
    log: list[str] = []
    reqs = [_Req(log, "a", 50), _Req(log, "b", 3), _Req(log, "c", 10)]
    assert wait_each(reqs, time.monotonic() + 5) == [None, None, None]
    assert log[:3] == ["post a", "post b", "post c"]
    assert log[3:] == ["done b", "done c", "done a"]  # a long first request does not hold back the others


def test_one_error_per_request_in_order():
    log: list[str] = []
    reqs = [_Req(log, "a", 2), _Req(log, "b", 1, fail=True), _Req(log, "c", 1_000_000_000)]
    out = wait_each(reqs, time.monotonic() + 0.2)
    assert out[0] is None
    assert isinstance(out[1], TransferError) and not isinstance(out[1], TransferTimeout)
    assert isinstance(out[2], TransferTimeout) and "c" in str(out[2])
    assert reqs[2].finished is None  # left to finish: its memory and slot stay held by the caller


def test_nothing_to_wait_for():
    assert wait_each([], time.monotonic()) == []
