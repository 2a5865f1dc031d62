"""`settle`: what ending a split tail shares across releases (the kept leading pages, cancelling reads)."""

import logging

import torch

from hicache_gds_sglang.settle import Kept, cancel_reads


def test_kept_keeps_the_leading_complete_pages_up_to_keep():
    k = Kept(keep=192, page_size=64)
    a = torch.randperm(1000)[:128]
    b = torch.randperm(1000)[:128]
    assert k.take(a, ["a0", "a1"], usable=128, key_tokens=128) == 128  # whole operation, all kept
    assert k.take(b, ["b0", "b1"], usable=128, key_tokens=128) == 64   # only what `keep` leaves
    lead, hi, hv = k.result()
    assert lead == 256 and torch.equal(hi, torch.cat([a, b[:64]])) and hv == ["a0", "a1", "b0"]


def test_a_short_or_missing_operation_ends_the_run():
    k = Kept(keep=10_000, page_size=64)
    a = torch.arange(192)
    assert k.take(a, ["x", "y", "z"], usable=64, key_tokens=192) == 64  # read short: nothing after it joins
    assert k.take(torch.arange(64), ["w"], usable=64, key_tokens=64) == 0
    assert k.result()[0] == 64
    k2 = Kept(keep=10_000, page_size=64)
    k2.broken()  # revoked first operation
    assert k2.take(torch.arange(64), ["w"], usable=64, key_tokens=64) == 0
    assert k2.result() == (0, None, [])


def test_cancel_reads_survives_a_backend_that_fails(caplog):
    class Bad:
        def cancel_read(self, hi):
            raise OSError("injected")

    class Good:
        seen = None

        def cancel_read(self, hi):
            Good.seen = hi

    with caplog.at_level(logging.WARNING, logger="hicache_gds_sglang.policy"):
        cancel_reads(Bad(), torch.arange(4))
    assert "cancelling a split tail's reads failed (OSError: injected)" in caplog.text
    cancel_reads(Good(), torch.arange(3))
    assert torch.equal(Good.seen, torch.arange(3))
    cancel_reads(None, torch.arange(3))   # no backend, no host indices, no method: nothing to do
    cancel_reads(Good(), None)
    cancel_reads(object(), torch.arange(3))
