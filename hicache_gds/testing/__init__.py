"""Conformance suites shipped with the package, so third-party engines can reuse them.

    from hicache_gds.testing import EngineTests
    class TestMyEngine(EngineTests):
        engine_name = "my-engine"
"""

from .engine_tests import EngineTests, random_bytes

__all__ = ["EngineTests", "random_bytes"]
