"""HiCacheGDS's `get_stats()` reaches SGLang's storage metrics (``--enable-metrics``), through the
installed SGLang's own classes: under 0.5.23 the collector `StorageAttachment._resolve_metrics_collector`
builds, fed the way `UnifiedRadixCache.check_hicache_events` feeds it every scheduler tick
(unified_radix_cache.py:3701-3707); under 0.5.17 the `StorageMetricsCollector` HiRadixCache builds
with the same labels and feeds `get_stats()` straight into (hiradix_cache.py:1513-1516)."""

from __future__ import annotations

import types
import uuid

import pytest

from sgl_helpers import attach, indices, keys, make_pool, poison, same_pages, storage_config

prometheus_client = pytest.importorskip("prometheus_client", reason="SGLang's metrics need prometheus-client")
from sglang.srt.observability.metrics_collector import StorageMetrics, StorageMetricsCollector  # noqa: E402

try:  # 0.5.23; 0.5.17 has neither (its HiRadixCache builds the collector itself, without an injector)
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageFailureInjector
    from sglang.srt.mem_cache.unified_cache.storage_attachment import StorageAttachment
except ImportError:
    HiCacheStorageFailureInjector = StorageAttachment = None


@pytest.fixture(scope="module")
def collector():
    """One collector per process, as in SGLang (a second would register its metrics twice)."""
    sc = storage_config(None)
    if StorageAttachment is None:  # 0.5.17: HiRadixCache._init_storage's labels and class
        return StorageMetricsCollector(labels={
            "storage_backend": "dynamic", "tp_rank": sc.tp_rank, "dp_rank": 0, "pp_rank": 0, "pp_size": 1,
            "attn_cp_rank": 0, "attn_cp_size": 1})
    cache = types.SimpleNamespace(storage_metrics_collector=None, cache_controller=types.SimpleNamespace(
        storage_config=sc, get_attn_cp_rank_and_size=lambda: (0, 1)))
    c = StorageAttachment._resolve_metrics_collector(types.SimpleNamespace(_cache=cache), "dynamic", None)
    assert isinstance(c, StorageMetricsCollector)
    return c


def tick(backend, collector) -> None:
    """What check_hicache_events does with the storage backend each tick."""
    storage_metrics = backend.get_stats()
    if storage_metrics is None:
        storage_metrics = StorageMetrics()
    if not hasattr(storage_metrics, "prefetch_stats"):
        storage_metrics.prefetch_stats = {}
    collector.log_storage_metrics(storage_metrics)


def sample(collector, name: str) -> float:
    v = prometheus_client.REGISTRY.get_sample_value(name, {k: str(v) for k, v in collector.labels.items()})
    return 0.0 if v is None else v


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "failure-injector"])
def test_get_stats_reaches_sglangs_storage_histograms(gds_dir, collector, monkeypatch, wrapped):
    if wrapped and HiCacheStorageFailureInjector is None:
        pytest.skip("this SGLang has no HiCacheStorageFailureInjector")
    if wrapped:  # SGLang wraps the backend when its test injector is on; get_stats passes through it
        monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.0001")
        monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.0")
    collector.labels = dict(collector.labels, storage_backend=f"gds-{uuid.uuid4().hex[:6]}")  # fresh series
    pool = make_pool("mha", "page_first")
    b = attach(storage_config(gds_dir), pool)
    try:
        if HiCacheStorageFailureInjector is not None:
            assert isinstance(b, HiCacheStorageFailureInjector) == wrapped
        ks = keys(20)
        assert b.batch_set_v1(ks[:16], indices(range(16))) == [True] * 16
        assert b.batch_set_v1(ks[16:], indices(range(16, 20))) == [True] * 4
        poison(pool, range(32, 50))
        assert b.batch_get_v1(ks[:16], indices(range(32, 48))) == [True] * 16
        assert b.batch_get_v1(ks[16:18], indices(range(48, 50))) == [True] * 2
        assert same_pages(pool, list(range(18)), pool, list(range(32, 50)))
        tick(b, collector)
        assert sample(collector, "sglang:backup_pgs_count") == 2 and sample(collector, "sglang:backup_pgs_sum") == 20
        assert sample(collector, "sglang:prefetch_pgs_count") == 2
        assert sample(collector, "sglang:prefetch_pgs_sum") == 18
        for name in ("sglang:backup_bandwidth", "sglang:prefetch_bandwidth"):
            assert sample(collector, f"{name}_count") == 2 and sample(collector, f"{name}_sum") > 0
        tick(b, collector)  # drained: the next tick adds nothing
        assert sample(collector, "sglang:backup_pgs_count") == 2 and sample(collector, "sglang:prefetch_pgs_count") == 2
        # the scrape SGLang's /metrics serves carries them
        text = prometheus_client.generate_latest().decode()
        assert 'sglang:backup_pgs_count{' in text and collector.labels["storage_backend"] in text
    finally:
        b.close()
