"""Conformance suites shipped with the package, so third-party engines can reuse them.

    from hicache_gds.testing import EngineTests, StoreTests
    class TestMyEngine(EngineTests):
        engine_name = "my-engine"
    class TestMyStore(StoreTests):
        def open_store(self, gds_dir): ...

`EngineTests` and `StoreTests` are pytest classes, so pytest is imported when one of them (or
`random_bytes`) is first asked for, never by importing this package: the reliability harness modules beside it
(`targets`, `torture`, ...) run in processes without pytest.
"""

from typing import Any

__all__ = ["EngineTests", "StoreTests", "random_bytes"]


def __getattr__(name: str) -> Any:
    if name == "StoreTests":
        from .store_tests import StoreTests
        return StoreTests
    if name in __all__:
        from . import engine_tests
        return getattr(engine_tests, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
