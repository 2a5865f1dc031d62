"""`hicache-gds-bench`: a fio-style benchmark for KV-page IO (options, job files, stats, reports)."""

__all__: list[str] = []
