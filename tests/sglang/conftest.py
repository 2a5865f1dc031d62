"""Tests of the SGLang backend (plugins/sglang) against SGLang's real classes (0.5.23 or 0.5.17), on CPU.

When SGLang (or the plugin) cannot be imported, every test module here is replaced by one skipped
test giving the reason, so `pytest tests` and `pytest tests/sglang` both report it as a skip.
`scripts/install-sglang-test-deps.sh` builds the venv these tests need (0.5.23), and with
`--overlay DIR` the 0.5.17 overlay that `PYTHONPATH=DIR` puts in front of it (scripts/test.sh
runs this directory both ways).
"""

import os
import sys

import pytest

try:
    import sglang.srt.mem_cache.hicache_storage  # noqa: F401
    import sglang.srt.mem_cache.storage.backend_factory  # noqa: F401

    import hicache_gds_sglang  # noqa: F401
    MISSING = None
except Exception as exc:  # noqa: BLE001 -- any import failure means "not this venv"
    MISSING = (f"SGLang or hicache-gds-sglang is not importable ({type(exc).__name__}: {exc}); build the venv "
               f"with scripts/install-sglang-test-deps.sh .venv-sgl/bin/python, install . and plugins/sglang "
               f"into it, and run .venv-sgl/bin/python -m pytest tests/sglang")

sys.path.insert(0, os.path.dirname(__file__))  # sgl_helpers
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # tests/: sglang_pools

if MISSING:
    class _SkippedTest(pytest.Item):
        def runtest(self) -> None:
            pytest.skip(MISSING)

        def reportinfo(self):
            return self.path, None, self.name

    class _SkippedModule(pytest.File):
        def collect(self):
            yield _SkippedTest.from_parent(self, name="needs-sglang")

    def pytest_pycollect_makemodule(module_path, parent):
        return _SkippedModule.from_parent(parent, path=module_path)


@pytest.fixture(autouse=True)
def _no_injector(monkeypatch):
    for k in ("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE",
              "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"):
        monkeypatch.delenv(k, raising=False)
