"""kill -9 mid-write: acknowledged pages survive byte-exact, torn pages are never served.

Every round kills the writer only after it acknowledged its first batch (`after_first_ack`), so no
round can pass without pages that had to survive."""

import pytest

from hicache_gds.testing.crash import run_rounds

# kill -9 rounds in subprocesses: ~45 s on 2 cores (scripts/test.sh --quick leaves them out)
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("engine", ["nixl-posix", "bounce"])
def test_kill9_during_puts(gds_dir, engine):
    t = run_rounds(gds_dir, 4, engine=engine, seed=1, max_delay=0.6, after_first_ack=True)
    assert t["kills"] == 4 and t["rounds_with_acks"] == 4 and t["acked_pages"] >= 4 * 16 and t["present_checked"] > 0
    assert t["acked_lost"] == 0 and t["torn_served"] == 0


def test_kill9_during_eviction(gds_dir):
    # capacity of 48 pages: every batch after the third evicts
    t = run_rounds(gds_dir, 4, capacity=48 * (64 << 10), mode="evict", seed=2, max_delay=0.6, after_first_ack=True)
    assert t["rounds_with_acks"] == 4 and t["present_checked"] > 0 and t["torn_served"] == 0


def test_kill9_during_clear(gds_dir):
    t = run_rounds(gds_dir, 3, mode="clear", seed=3, max_delay=1.0, after_first_ack=True)
    assert t["rounds_with_acks"] == 3 and t["torn_served"] == 0
